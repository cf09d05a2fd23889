"""A task's datasets loaded once by the warm server (:mod:`ddppipe.launching.warm`) and kept,
so that the ranks it forks start with them (copy-on-write) instead of loading the prepared
data again.

Kept by the task's source (its SHA-256), the prepared data (its manifest's digest and its
folder: a rank reading data staged on its node reads that copy) and the task's arguments: a
rank whose run differs in any of them loads its own. A task whose
``datasets()`` opens files lazily keeps only what it loaded; nothing of the kept objects
changes in the server when a rank changes its copy.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from ddppipe.tasks.loading import Task, validate_args

log = logging.getLogger(__name__)
_KEPT: dict[str, Any] = {}


def _key(task: Task, data_dir: Path, args: dict[str, Any]) -> str | None:
    try:
        digest = json.loads((Path(data_dir) / "manifest.json").read_text())["digest"]
    except (OSError, ValueError, KeyError):
        return None
    where = str(Path(data_dir).resolve())  # a rank reading staged data reads its own copy
    return json.dumps([task.source.sha256, digest, where, args], sort_keys=True, default=str)


def keep(task: Task, data_dir: Path, args: dict[str, Any]) -> bool:
    """Load and keep the task's datasets of ``data_dir`` for ``args`` as a run's config gives
    them (checked and filled in as its resolved config has them); False: its data is not
    prepared."""
    args = validate_args(task, args)
    key = _key(task, data_dir, args)
    if key is None:
        return False
    if key not in _KEPT:
        _KEPT[key] = task.call("datasets", data_dir, args)
    return True


def datasets(task: Task, data_dir: Path, args: dict[str, Any]) -> Any:
    """The task's ``datasets(data_dir, args)``: the kept ones when the warm server loaded
    them for this very task, data and arguments, else loaded now."""
    key = _key(task, data_dir, args)
    kept = _KEPT.get(key) if key is not None else None
    if kept is None:
        return task.call("datasets", data_dir, args)
    log.info("the datasets of %s kept by the warm server (not loaded again)", data_dir)
    return kept


def drop() -> int:
    """Forget every kept dataset (their memory freed as no rank holds them); how many."""
    count = len(_KEPT)
    _KEPT.clear()
    return count
