"""Training snapshots: written atomically by rank 0, resumed from the newest valid one.

Checkpoints live in a run's state folder, outside Snakemake's declared outputs, so that a
failed or preempted job (whose outputs Snakemake deletes) keeps them for the next attempt.
"""

from __future__ import annotations

import logging
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ddppipe import atomic

log = logging.getLogger(__name__)

FORMAT = 1
_NAME = re.compile(r"^ckpt-e(\d{4})-s(\d{6})\.pt$")
REQUIRED_KEYS = frozenset(
    {
        "format",
        "config_hash",
        "epoch",
        "step",
        "model",
        "optimizer",
        "scheduler",
        "rng",
        "history",
        "meta",
    }
)


class CheckpointError(RuntimeError):
    """A checkpoint could not be read or does not fit the run."""


def file_name(epoch: int, step: int) -> str:
    """``epoch`` completed epochs plus ``step`` steps into the next one."""
    return f"ckpt-e{epoch:04d}-s{step:06d}.pt"


def save(snapshot: dict[str, Any], path: Path) -> None:
    """Write a snapshot atomically (temp file, fsync, rename)."""
    with atomic.atomic_path(path) as tmp:
        torch.save(snapshot, tmp)


def load(path: Path) -> dict[str, Any]:
    """Read a snapshot with ``weights_only=True``; raise CheckpointError when unusable."""
    try:
        snapshot = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for a damaged file
        raise CheckpointError(f"{path}: unreadable checkpoint ({type(e).__name__}: {e})") from e
    if not isinstance(snapshot, dict) or not snapshot.keys() >= REQUIRED_KEYS:
        raise CheckpointError(f"{path}: not a ddppipe checkpoint (missing keys)")
    if snapshot["format"] != FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {snapshot['format']}, expected {FORMAT}")
    return snapshot


@dataclass
class Store:
    """The checkpoints of one run, in one folder."""

    folder: Path
    keep: int = 2

    def paths(self) -> list[Path]:
        """Checkpoint files, oldest first."""
        if not self.folder.is_dir():
            return []
        found = [p for p in self.folder.iterdir() if _NAME.match(p.name)]
        return sorted(found, key=lambda p: p.name)

    def save(self, snapshot: dict[str, Any]) -> Path:
        path = self.folder / file_name(snapshot["epoch"], snapshot["step"])
        save(snapshot, path)
        for old in self.paths()[: -self.keep]:
            old.unlink(missing_ok=True)
        return path

    def latest(self, config_hash: str) -> dict[str, Any] | None:
        """The newest readable checkpoint of this config, falling back past damaged ones.

        Checkpoints of a different training config are moved aside (never deleted) so the
        run starts over.
        """
        for path in reversed(self.paths()):
            try:
                snapshot = load(path)
            except CheckpointError as e:
                log.warning("%s; falling back to the previous checkpoint", e)
                continue
            if snapshot["config_hash"] != config_hash:
                self._move_aside(snapshot["config_hash"], config_hash)
                return None
            log.info("resuming from %s", path)
            return snapshot
        return None

    def _move_aside(self, old_hash: str, new_hash: str) -> None:
        stale = self.folder / f"stale-{old_hash}"
        stale.mkdir(exist_ok=True)
        for path in self.paths():
            shutil.move(path, stale / path.name)
        log.warning(
            "checkpoints in %s belong to training config %s, not %s: moved to %s, starting over",
            self.folder,
            old_hash,
            new_hash,
            stale,
        )
