"""The files a rank's training reads and writes, and its final outputs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddppipe.core import atomic, jsonl
from ddppipe.runstate.state import StateDir
from ddppipe.settings import layout
from ddppipe.training.checkpoints import checkpoint


@dataclass
class Paths:
    """What a task's training reads and writes: the run's layout (:mod:`ddppipe.settings.layout`)
    as the launcher passes it on (``ddppipe train --data --state --checkpoint --metrics``)."""

    data_dir: Path
    state: StateDir  # checkpoints and live metrics; survives failed jobs
    final_checkpoint: Path
    metrics: Path

    @property
    def _train(self) -> layout.TrainFiles:
        """The final checkpoint's folder (``results/<run>/train``) and its other files."""
        return layout.TrainFiles(Path(self.final_checkpoint).parent)

    @property
    def evaluation(self) -> Path:
        """The final model's test-set evaluation, next to the final checkpoint."""
        return self._train.evaluation

    @property
    def weights(self) -> Path:
        """The final model's weights alone (what export publishes, without loading torch)."""
        return self._train.weights

    @property
    def record(self) -> Path:
        """The final checkpoint's epochs, config hash and meta as JSON (for the provenance)."""
        return self._train.record


def write_outputs(
    paths: Paths, snapshot: dict[str, Any], history: list[dict[str, Any]],
    evaluation: dict[str, Any],
) -> None:  # fmt: skip
    """(Rank 0) A completed run's outputs: the final checkpoint, its weights and record, the
    metrics of every epoch and the final evaluation."""
    checkpoint.save(snapshot, paths.final_checkpoint)
    checkpoint.save_weights(snapshot, paths.weights)
    atomic.write_json(paths.record, checkpoint.record(snapshot))
    jsonl.write(paths.metrics, history)
    atomic.write_json(paths.evaluation, evaluation)
