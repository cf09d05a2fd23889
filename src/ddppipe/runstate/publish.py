"""Turning a finished training's state into the run's declared results, atomically.

A task's final checkpoint becomes its weights (a ``state_dict``); a script's output folder
(``job.output_dir()``) and logged metrics become the train rule's outputs.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from ddppipe.core import atomic, jsonl
from ddppipe.runstate.state import StateDir


def copy_tree(src: Path, dest: Path) -> None:
    """Copy folder ``src`` to ``dest`` (replaced) through a temporary folder and a rename."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    try:
        shutil.copytree(src, tmp, dirs_exist_ok=True) if Path(src).is_dir() else None
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def script_results(state: StateDir, outputs: Path, metrics: Path) -> None:
    """(Launcher, a script run complete) Publish its output folder and its logged metrics."""
    copy_tree(state.outputs, outputs)
    jsonl.write(metrics, jsonl.read(state.metrics))


def copy_file(src: Path, dest: Path) -> None:
    """Copy file ``src`` to ``dest`` (replaced) through a temporary file and a rename."""
    with atomic.atomic_path(dest) as tmp:
        shutil.copyfile(src, tmp)
