"""The run's resolved config: validated, its preset applied, its task checked, written once."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ddppipe import tasks
from ddppipe.spec import config, layout

log = logging.getLogger(__name__)


def write_resolved(
    cfg: dict[str, Any], path: str | Path, gpus: bool | None = None
) -> dict[str, Any]:
    """Resolve ``cfg`` (``gpus``: see :func:`ddppipe.spec.config.resolve`) and write it, with
    the task's checked ``task_args`` and its source.

    The task (or script) is located, its ``task_args`` validated against its ARGS_SCHEMA, its
    source (file, SHA-256, version) recorded as ``task_source``, and its model built once: a
    broken task fails here, on the submitting side, not in an allocation.
    """
    resolved = config.resolve(cfg, gpus)
    if layout.kind(resolved) == "script":
        resolved["task_source"] = tasks.locate_script(resolved["script"]).as_dict()
    else:
        task = tasks.load(resolved["task"], step="write_config (ddppipe resolve-config)")
        resolved["task_args"] = tasks.validate_args(task, resolved["task_args"])
        resolved["task_source"] = task.source.as_dict()
        log.info("%s", tasks.check_model(task, resolved["task_args"]))
    config.write(resolved, path)
    return resolved
