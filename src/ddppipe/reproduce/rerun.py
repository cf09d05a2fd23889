"""Train the reproduction in its own run folder (``ddppipe launch``, as the train rule does)
and export its weights and provenance (as the export rule does)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from ddppipe.core import atomic
from ddppipe.core.errors import UserError
from ddppipe.runstate import publish
from ddppipe.settings import config as configs
from ddppipe.settings import layout
from ddppipe.training.tracking import provenance


class TrainingFailed(RuntimeError, UserError):
    """The reproduction's training did not complete."""


def train(cfg: dict[str, Any], data: Path, root: Path, cwd: Path) -> None:
    """Write ``cfg`` into the new run folder ``root``, train it there (working directory
    ``cwd``, the log in ``logs/<run>/train.log``), export it; raise :class:`TrainingFailed`."""
    run = layout.RunLayout.of_root(root)
    run.root.mkdir(parents=True)
    configs.write(cfg, run.config)
    log = cwd / run.log("train")
    log.parent.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, "-m", "ddppipe", "launch", "--config", str(run.config.resolve()),
        "--data", str(data.resolve()), "--state", str(run.state.resolve()),
        "--checkpoint", str(run.train.final_checkpoint.resolve()),
        "--metrics", str(run.train.metrics.resolve()),
        "--attempts", str(run.train.attempts.resolve()), "--log", str(log.resolve()),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.splitlines()[-15:])
        raise TrainingFailed(f"the reproduction's training failed (exit {done.returncode}; "
                             f"its log: {log}):\n{tail}")  # fmt: skip
    export(run, data)


def export(run: layout.RunLayout, data: Path) -> None:
    """The reproduction's export/model.pt and export/provenance.json (no image recorded: the
    run's own was checked before training)."""
    run.export.root.mkdir(parents=True, exist_ok=True)
    publish.copy_file(run.train.weights, run.export.weights)
    final = json.loads(run.train.record.read_text())
    attempts = json.loads(run.train.attempts.read_text())
    atomic.write_json(run.export.provenance, provenance.record(final, data, None, attempts))
