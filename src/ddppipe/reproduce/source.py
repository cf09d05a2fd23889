"""A finished run's record, found from its folder, its ``export/provenance.json`` or a
``model.pt`` beside one."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ddppipe.core import jsonl
from ddppipe.core.errors import UserError
from ddppipe.settings import layout


class NoRecord(FileNotFoundError, UserError):
    """The path is no finished run with a provenance record."""


@dataclass(frozen=True)
class Recorded:
    """What a finished run wrote: its folder, provenance, resolved config, metrics, weights."""

    root: Path  # results/<run>: the folder above export/
    provenance: dict[str, Any]
    config: dict[str, Any] | None  # results/<run>/config.yaml, when there
    metrics: list[dict[str, Any]]  # train/metrics.jsonl: one line per epoch
    evaluation: dict[str, Any] | None  # train/evaluation.json: the final evaluation
    weights: Path  # export/model.pt

    @property
    def attempts(self) -> list[dict[str, Any]]:
        return self.provenance.get("attempts") or []

    @property
    def steps_per_epoch(self) -> int | None:
        """Optimizer steps an epoch: the last slot's end step over the epochs trained."""
        epochs = self.provenance.get("epochs")
        end = self.attempts[-1].get("end_step") if self.attempts else None
        return end // epochs if end and epochs else None

    @property
    def split_epochs(self) -> set[int]:
        """The epochs (1 = the first) a slot resumed inside of: their ``train_loss`` is the
        mean over the steps after the resume only, not the whole epoch's."""
        steps = self.steps_per_epoch
        starts = [a.get("start_step") or 0 for a in self.attempts]
        return {s // steps + 1 for s in starts if steps and s % steps} if steps else set()

    @property
    def first_world_size(self) -> int:
        """The world size the run started at (its first slot's; else its record's)."""
        if self.attempts:
            return int(self.attempts[0]["world_size"])
        if self.metrics:
            return int(self.metrics[0]["world_size"])
        return int(self.provenance["training"]["world_size"])


def _provenance_of(path: Path) -> Path:
    """The provenance file that ``path`` (a run folder, a provenance, a model.pt) names."""
    if path.is_dir():
        return layout.ExportFiles(path / "export").provenance
    if path.name.endswith(".json"):
        return path
    return path.with_name("provenance.json")


def script_run(provenance: Path, found: dict[str, Any]) -> str:
    """Why a script run is not reproduced, and what to do instead."""
    script = (found.get("script") or {}).get("path") or "its script"
    commit = ((found.get("git") or {}).get("commit") or "")[:12]
    checkout = f"check out commit {commit} (the record's git), " if commit else ""
    return (
        f"{provenance}: the record of a script run ({script}); ddppipe reproduce trains task "
        "runs only: a script trains with its own code, whose weights and per-epoch numbers "
        "ddppipe does not know, so it cannot train it to a comparable end. To run it again, "
        f"{checkout}copy the run's config.yaml under another run name and run it "
        "(snakemake, or ddppipe launch), then compare its export/outputs with the record's "
        "outputs_sha256"
    )


def find(path: Path) -> Recorded:
    """The record of the run at ``path``; raise :class:`NoRecord`."""
    provenance = _provenance_of(Path(path))
    if not provenance.is_file():
        raise NoRecord(
            f"{path}: no provenance record ({provenance} missing); give a finished run's "
            "folder (results/<run>), its export/provenance.json or the model.pt beside it"
        )
    found = json.loads(provenance.read_text())
    if "train_config" not in found:
        raise NoRecord(script_run(provenance, found))
    run = layout.RunLayout.of_root(provenance.parent.parent)
    config_file, evaluation = run.config, run.train.evaluation
    return Recorded(
        root=run.root,
        provenance=found,
        config=yaml.safe_load(config_file.read_text()) if config_file.is_file() else None,
        metrics=jsonl.read(run.train.metrics),
        evaluation=json.loads(evaluation.read_text()) if evaluation.is_file() else None,
        weights=provenance.with_name("model.pt"),
    )
