"""The run's resolved config: validated, its preset applied, its task checked, written once."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from ddppipe import __version__, tasks
from ddppipe.core import atomic, hashing
from ddppipe.settings import config, layout

log = logging.getLogger(__name__)


def write_resolved(
    cfg: dict[str, Any], path: str | Path, gpus: bool | None = None
) -> dict[str, Any]:
    """Resolve ``cfg`` (``gpus``: see :func:`ddppipe.settings.config.resolve`; None: decided
    here, as for a local run, by :func:`ddppipe.parallel.devices.trains_on_gpus`) and write it,
    with the task's checked ``task_args`` and its source.

    The task (or script) is located, its ``task_args`` validated against its ARGS_SCHEMA, its
    source (file, SHA-256, version) recorded as ``task_source``, and its model built once: a
    broken task fails here, on the submitting side, not in an allocation.
    """
    if gpus is None:  # (a None here once meant CPUs: a GPU run got the CPU recipe)
        from ddppipe.parallel import devices

        gpus = devices.trains_on_gpus(config.validate(cfg), slurm=False)
    resolved = config.resolve(cfg, gpus)
    if layout.kind(resolved) == "script":
        resolved["task_source"] = tasks.locate_script(resolved["script"]).as_dict()
    else:
        resolved.update(checked_task(resolved["task"], resolved["task_args"]))
    config.write(resolved, path)
    return resolved


def _check_key(source: tasks.Source, args: dict[str, Any]) -> str:
    """What a task's check depends on: its file, its arguments, this Python and image."""
    image = os.environ.get("APPTAINER_CONTAINER") or os.environ.get("SINGULARITY_CONTAINER")
    stat = os.stat(image) if image and os.path.exists(image) else None
    keyed = {"source": source.as_dict(), "task_args": args, "python": sys.executable,
             "ddppipe": __version__, "image": image,
             "image_stat": stat and [stat.st_size, stat.st_mtime_ns]}  # fmt: skip
    return hashing.sha256(json.dumps(keyed, sort_keys=True, default=str).encode())[:24]


def checked_task(ref: str, args: dict[str, Any]) -> dict[str, Any]:
    """The task's ``task_args`` checked against its ARGS_SCHEMA, its ``task_source``, and its
    model built once (a broken task fails here, on the submitting side); raise TaskError.

    A check that passed is kept (layout.TASK_CHECKS, by the task's file, arguments, Python
    and image), so the trials of a sweep that share their task_args import the task and
    torch once, not once each; the trials' write_configs that start together wait for the
    first one's check (a lock) instead of each building the model beside it.
    """
    source = tasks.locate(ref)
    kept = layout.TASK_CHECKS / f"{_check_key(source, args)}.json"
    kept.parent.mkdir(parents=True, exist_ok=True)
    with open(kept.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if kept.is_file():
            found = json.loads(kept.read_text())
            log.info("%s (checked before: %s)", found.pop("model"), kept)
            return found
        task = tasks.load(ref, step="write_config (ddppipe resolve-config)")
        found = {"task_args": tasks.validate_args(task, args),
                 "task_source": task.source.as_dict()}  # fmt: skip
        line = tasks.check_model(task, found["task_args"])
        log.info("%s", line)
        atomic.write_text(kept, json.dumps({**found, "model": line}))  # in order: one config
        return found
