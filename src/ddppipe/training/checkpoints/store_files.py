"""The file helpers both checkpoint stores share, so that they keep a run's checkpoint folder
one way (whole snapshots' files, :mod:`ddppipe.training.checkpoints.checkpoint`; sharded
checkpoints' folders, :mod:`ddppipe.training.checkpoints.sharded_checkpoint`): the checkpoints'
names, the temporary files of killed saves removed, damaged checkpoints moved to ``damaged/``
and another config's to ``stale-<hash>/`` (nothing else is deleted), and the message of a
failed write.
"""

from __future__ import annotations

import errno
import logging
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddppipe.core import atomic

log = logging.getLogger(__name__)

FILE_PATTERN = re.compile(r"^ckpt-e(\d{4})-s(\d{6})\.pt$")  # a whole snapshot's file
FOLDER_PATTERN = re.compile(r"^ckpt-e(\d{4})-s(\d{6})$")  # a sharded checkpoint's folder


def stem(epoch: int, step: int) -> str:
    """The name of the checkpoint at ``epoch`` completed epochs plus ``step`` steps into the
    next one (a file adds ``.pt``)."""
    return f"ckpt-e{epoch:04d}-s{step:06d}"


def move_into(path: Path, folder: Path) -> Path:
    """Move ``path`` into ``folder`` without overwriting: ``<stem>.<n><suffix>`` on a clash."""
    folder.mkdir(exist_ok=True)
    dest, n = folder / path.name, 0
    while dest.exists():
        n += 1
        dest = folder / f"{path.stem}.{n}{path.suffix}"
    shutil.move(path, dest)
    return dest


def set_aside_damaged(path: Path, error: Exception) -> None:
    """Move the unreadable checkpoint ``path`` to ``damaged/`` beside it (the store falls back
    to the one before)."""
    moved = move_into(path, path.parent / "damaged")
    log.warning("%s; moved to %s, falling back to the previous checkpoint", error, moved)


def set_aside_stale(folder: Path, paths: list[Path], old_hash: str, new_hash: str) -> None:
    """Move ``paths``, the checkpoints of training config ``old_hash``, to ``stale-<old_hash>/``
    (the run of ``new_hash`` starts over)."""
    stale = folder / f"stale-{old_hash}"
    for path in paths:
        move_into(path, stale)
    log.warning(
        "checkpoints in %s belong to training config %s, not %s: moved to %s, starting over",
        folder, old_hash, new_hash, stale,
    )  # fmt: skip


def newest(
    folder: Path, paths: list[Path], config_hash: str,
    read: Callable[[Path], dict[str, Any]], damaged: type[Exception],
) -> tuple[Path, dict[str, Any]] | None:  # fmt: skip
    """The newest of ``paths`` (oldest first) that ``read`` reads, and what it read, where it
    is of ``config_hash``: one that raises ``damaged`` is set aside (damaged/) for the one
    before; one of another config sets all of them aside (stale-<hash>/) and gives None."""
    for path in reversed(paths):
        try:
            state = read(path)
        except damaged as e:
            set_aside_damaged(path, e)
            continue
        if state["config_hash"] != config_hash:
            set_aside_stale(folder, [p for p in paths if p.exists()], state["config_hash"],
                            config_hash)  # fmt: skip
            return None
        log.info("resuming from %s", path)
        return path, state
    return None


def remove_if_temporary(path: Path) -> None:
    """Remove ``path`` if it is the temporary file of a whole snapshot's save that was killed."""
    if FILE_PATTERN.match(atomic.temp_target(path.name) or ""):
        path.unlink(missing_ok=True)
        log.warning("removed %s, left by an interrupted checkpoint save", path)


def write_failure(e: BaseException, rank: int = 0) -> str:
    """A rank's message for a failed write, with the space left when the disk is full."""
    if not isinstance(e, OSError) or e.filename is None:
        return f"rank {rank} could not write: {type(e).__name__}: {e}"
    path = Path(e.filename)
    text = f"rank {rank} could not write {path}: [Errno {e.errno}] {e.strerror}"
    if e.errno == errno.ENOSPC:  # the partial file is gone: this is the space the write had
        disk = shutil.disk_usage(path.parent)
        text += (
            f"; {path.parent} has {disk.free / 2**20:.1f} MiB free "
            f"(of {disk.total / 2**20:.1f} MiB): make room there"
        )
    return text
