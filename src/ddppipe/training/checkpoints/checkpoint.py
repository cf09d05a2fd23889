"""Training snapshots: written atomically by rank 0, resumed from the newest valid one.

Checkpoints live in a run's state folder, outside Snakemake's declared outputs, so that a
failed or preempted job (whose outputs Snakemake deletes) keeps them for the next attempt.
Only one training writes a state folder at a time, so a temporary file found there when the
store saves or resumes was left by a killed writer. Nothing is ever deleted but those and the
checkpoints beyond ``keep``: damaged ones go to ``damaged/``, another config's to ``stale-<hash>/``.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ddppipe.core import atomic
from ddppipe.core.errors import UserError
from ddppipe.training.checkpoints import store_files

FORMAT = 1
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


T = TypeVar("T")


class CheckpointError(RuntimeError, UserError):
    """A checkpoint could not be read or written, or does not fit the run."""


@dataclass
class Trainable:
    """What a snapshot saves and restores of a training: its stateful parts."""

    model: Any
    optimizer: Any
    scheduler: Any


def on_cpu(state: Any) -> Any:
    """``state`` (a state dict: nested dicts, lists and tuples of tensors and values) with its
    tensors on the CPU, detached."""
    if isinstance(state, torch.Tensor):
        return state.detach().cpu()
    if isinstance(state, dict):
        return {k: on_cpu(v) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(on_cpu(v) for v in state)
    return state


def snapshot(
    config_hash: str, epoch: int, step: int, states: dict[str, Any], rng: list[Any],
    history: list[dict[str, Any]], meta: dict[str, Any],
) -> dict[str, Any]:  # fmt: skip
    """A training's state at (``epoch`` completed epochs, ``step`` steps into the next);
    ``states``: the state dicts of its ``model``, ``optimizer`` and ``scheduler``."""
    return {
        "format": FORMAT,
        "config_hash": config_hash,
        "epoch": epoch,
        "step": step,
        "model": states["model"],
        "optimizer": states["optimizer"],
        "scheduler": states["scheduler"],
        "rng": rng,  # one entry per rank
        "history": history,
        "meta": meta,
    }


def restore(snapshot_: dict[str, Any], parts: Trainable) -> tuple[int, int, list[dict[str, Any]]]:
    """Load a snapshot's weights, optimizer and scheduler into ``parts``; its (epoch, step,
    history). The per-rank RNG states are the caller's (they depend on the world size)."""
    parts.model.load_state_dict(snapshot_["model"])
    parts.optimizer.load_state_dict(snapshot_["optimizer"])
    parts.scheduler.load_state_dict(snapshot_["scheduler"])
    return snapshot_["epoch"], snapshot_["step"], snapshot_["history"]


def file_name(epoch: int, step: int) -> str:
    """``epoch`` completed epochs plus ``step`` steps into the next one."""
    return store_files.stem(epoch, step) + ".pt"


def serialized(snapshot: dict[str, Any]) -> bytes:
    """A snapshot as :func:`save` writes it, in memory (what it holds now)."""
    data = io.BytesIO()
    torch.save(snapshot, data)
    return data.getvalue()


def save(snapshot: dict[str, Any] | bytes, path: Path) -> None:
    """Write a snapshot (or its :func:`serialized` bytes) atomically (temp file, fsync,
    rename); OSError naming ``path`` if not."""
    try:
        with atomic.atomic_path(path) as tmp, open(tmp, "wb") as f:
            if isinstance(snapshot, bytes):
                f.write(snapshot)
            else:
                torch.save(snapshot, f)
    except RuntimeError as e:  # torch's writer hides a failed write's OSError (disk full)
        if isinstance(e.__context__, OSError):
            raise OSError(e.__context__.errno, e.__context__.strerror, str(path)) from e
        raise
    except OSError as e:  # (a file's write names no file)
        if e.filename is None:
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise


def save_weights(snapshot: dict[str, Any], path: Path) -> None:
    """Write a snapshot's model weights (its ``state_dict``, on the CPU) atomically; the same
    weights give the same bytes (saved through a file object, torch names the archive's
    folder "archive", not after the temporary file)."""
    with atomic.atomic_path(path) as tmp, open(tmp, "wb") as f:
        torch.save(on_cpu(snapshot["model"]), f)


def record(snapshot: dict[str, Any]) -> dict[str, Any]:
    """What a snapshot says of its training, as JSON: epochs, config hash, meta."""
    return {k: snapshot[k] for k in ("epoch", "config_hash", "meta")}


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
        found = [p for p in self.folder.iterdir() if store_files.FILE_PATTERN.match(p.name)]
        return sorted(found, key=lambda p: p.name)

    def save(self, snapshot: dict[str, Any]) -> Path:
        """Write ``snapshot``, then remove all but the newest ``keep`` checkpoints."""
        self._remove_leftovers()
        path = self.folder / file_name(snapshot["epoch"], snapshot["step"])
        save(snapshot, path)
        for old in self.paths()[: -self.keep]:
            old.unlink(missing_ok=True)
        return path

    def latest(self, config_hash: str) -> dict[str, Any] | None:
        """The newest readable checkpoint of this config, falling back past damaged ones.

        Damaged checkpoints are moved to ``damaged/``; checkpoints of a different training
        config to ``stale-<hash>/``, so the run starts over.
        """
        self._remove_leftovers()
        found = store_files.newest(self.folder, self.paths(), config_hash, load, CheckpointError)
        return found[1] if found else None

    def _remove_leftovers(self) -> None:
        """Remove the temporary files of saves whose process was killed."""
        if not self.folder.is_dir():
            return
        for path in self.folder.iterdir():
            store_files.remove_if_temporary(path)


def rank0_writes(write: Callable[[], T]) -> T | None:
    """Collective: ``write()`` on rank 0; if it fails, every rank raises CheckpointError.

    Rank 0's outcome is broadcast in place of a barrier, so a failed write (a full disk) fails
    the other ranks at once with its message instead of leaving them waiting for it.
    """
    result: T | None = None
    error: Exception | None = None
    failure: list[str | None] = [None]  # rank 0's message, broadcast
    if dist.get_rank() == 0:
        try:
            result = write()
        except Exception as e:
            error, failure[0] = e, store_files.write_failure(e)
    dist.broadcast_object_list(failure, src=0)
    if failure[0] is None:
        return result
    if error is not None and not isinstance(error, OSError):
        raise error  # a bug, not the storage: keep its traceback
    raise CheckpointError(failure[0]) from error
