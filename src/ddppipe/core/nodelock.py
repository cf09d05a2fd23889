"""The lock under which one process of a node makes what the node's other processes then
reuse (a staged data folder, an unpacked image), in this user's private folder
(:mod:`ddppipe.core.private`).

The holder writes who it is into the lock file and touches it as it progresses
(:meth:`Holder.beat`); a waiter beats its own heartbeat meanwhile and gives up, naming the
holder, once the lock file has not moved for :data:`STALL_S`: no wait without a bound. What a
process makes is built under ``.<name>.<pid>.tmp`` and renamed into place last; the
temporary folders of processes killed before that are removed by the next process that
takes their lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import shutil
import socket
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from ddppipe.core.errors import UserError

log = logging.getLogger(__name__)

STALL_S = 300.0  # a holder silent this long is given up on (below the data phase's allowance)
BEAT_EVERY_S = 1.0
POLL_S = 0.2
_TEMPORARY = re.compile(r"\.(?P<name>.+)\.(?P<pid>\d+)\.tmp")


class LockError(RuntimeError, UserError):
    """Another process of the node holds the lock and shows no progress."""


def temporary(folder: Path, name: str) -> Path:
    """Where this process builds ``name`` in ``folder`` before renaming it into place."""
    return Path(folder) / f".{name}.{os.getpid()}.tmp"


def remove(path: Path) -> None:
    """``path`` gone, a file or a folder, read-only folders in it too (an image's modes)."""
    if path.is_symlink() or not path.is_dir():
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return
    for top, dirs, _ in os.walk(path):
        for name in dirs:
            sub = os.path.join(top, name)
            if not os.path.islink(sub):
                os.chmod(sub, stat.S_IRWXU)
    os.chmod(path, stat.S_IRWXU)
    shutil.rmtree(path)


class Holder:
    """The lock, held: :meth:`beat` says the holder progresses (to its waiters and, through
    ``progress``, to this rank's own heartbeat)."""

    def __init__(self, fd: int, progress: Callable[[], None]) -> None:
        self._fd, self._progress, self._touched = fd, progress, time.monotonic()

    def beat(self) -> None:
        self._progress()
        if time.monotonic() - self._touched >= BEAT_EVERY_S:
            os.utime(self._fd)
            self._touched = time.monotonic()


def _holder(path: Path) -> str:
    with contextlib.suppress(OSError, UnicodeDecodeError):
        if said := path.read_text().strip():
            return said
    return "a process that did not say which"


def _wait(fd: int, path: Path, progress: Callable[[], None]) -> None:
    """Take the lock ``fd`` (the file ``path``), beating ``progress`` while its holder
    progresses; raise LockError once the holder has been silent :data:`STALL_S` (counted
    from this wait's start at the earliest: a holder may not have written yet)."""
    began = time.time()
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        silent = time.time() - max(os.fstat(fd).st_mtime, began)
        if silent > STALL_S:
            raise LockError(
                f"{path} is held by {_holder(path)}, which has shown no progress for "
                f"{silent:,.0f} s (the limit: {STALL_S:,.0f} s): if that process hangs, end "
                "it, then run again (what it left is removed then)"
            )
        progress()
        time.sleep(POLL_S)


def _remove_leftovers(folder: Path, name: str) -> None:
    """The temporary folders in ``folder`` no living process is building any more: those of
    ``name`` (its lock is held here) and those whose lock nobody holds."""
    for entry in sorted(folder.iterdir()):
        found = _TEMPORARY.fullmatch(entry.name)
        if found is None:
            continue
        if found["name"] != name:
            with _tried(folder, found["name"]) as free:
                if free:
                    _remove_left(entry)
        else:
            _remove_left(entry)


def _remove_left(entry: Path) -> None:
    log.info("removing %s, left by a process that ended before it was complete", entry)
    with contextlib.suppress(FileNotFoundError):
        remove(entry)


def _open(folder: Path, name: str) -> tuple[int, Path]:
    path = Path(folder) / f".{name}.lock"
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600), path


@contextlib.contextmanager
def _tried(folder: Path, name: str) -> Iterator[bool]:
    """Whether the lock of ``name`` was free (then held in the block)."""
    fd, _ = _open(folder, name)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
        else:
            yield True
    finally:
        os.close(fd)


@contextlib.contextmanager
def held(folder: Path, name: str, progress: Callable[[], None]) -> Iterator[Holder]:
    """The node's lock of ``name`` in the private ``folder``, held in the block (waited for
    while another process holds it: :func:`_wait`); the leftovers of killed processes
    removed first."""
    fd, path = _open(folder, name)
    try:
        _wait(fd, path, progress)
        since = time.strftime("%Y-%m-%d %H:%M:%S")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {since}\n".encode(), 0)
        _remove_leftovers(Path(folder), name)
        yield Holder(fd, progress)
    finally:
        os.close(fd)  # (the lock with it)
