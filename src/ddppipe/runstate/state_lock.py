"""One training per state folder: an exclusive lock held by the launcher for a whole slot.

Two trainings on one ``results/<run>/state`` (an orphaned SLURM job after ``--unlock`` and a
resubmit, a hand-started ``ddppipe launch``) would prune each other's checkpoints. The lock
is ``flock`` on ``state/.lock``: the kernel releases it when the holder dies, however it dies;
NFS emulates it with POSIX locks across clients. Where the filesystem has none (e.g. Lustre
mounted without ``-o flock``) the launch fails and says so. :func:`held` tells another process
(a model-based sweep's next round, :mod:`ddppipe.sweeps.slots`) whether a training holds it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

from ddppipe.core.errors import UserError
from ddppipe.runstate.state import StateDir

UNSUPPORTED = (errno.ENOLCK, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP)
RETRIES_S = (0.05, 0.1, 0.2, 0.4)  # a probe by :func:`held` holds the lock for microseconds


class StateLockedError(RuntimeError, UserError):
    """Another training holds the state folder, or it cannot be locked; the message says which."""


@contextmanager
def hold(state: StateDir, job: str | None) -> Iterator[dict[str, object]]:
    """Hold ``state``'s lock for the block; raise StateLockedError at once if taken."""
    state.root.mkdir(parents=True, exist_ok=True)
    path = state.lock
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            _lock(fd)
        except BlockingIOError:
            holder = path.read_text(errors="replace").strip() or "unknown"
            raise StateLockedError(
                f"{state.root} is in use by another training ({holder}); two trainings on one "
                "state folder would prune each other's checkpoints: wait for it to end, or "
                "stop it (scancel JOB on SLURM, kill PID locally) and run again"
            ) from None
        except OSError as e:
            if e.errno in UNSUPPORTED:
                raise StateLockedError(
                    f"cannot lock {path}: {e.strerror} (the filesystem has no flock, e.g. Lustre "
                    "mounted without -o flock): put results/ on a filesystem with locking"
                ) from None
            raise
        owner = {"host": socket.gethostname(), "pid": os.getpid(), "job": job or "local",
                 "since": time.strftime("%Y-%m-%d %H:%M:%S")}  # fmt: skip
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(owner).encode(), 0)
        yield owner
    finally:
        os.close(fd)  # releases the lock


def _lock(fd: int) -> None:
    """Take the lock; raise BlockingIOError when a training holds it (a probe by :func:`held`,
    which holds it for microseconds, is waited out)."""
    for pause in RETRIES_S:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            time.sleep(pause)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def held(state: StateDir) -> bool:
    """Whether a training holds ``state``'s lock now (a launcher's slot is running); False
    where the filesystem cannot say (no flock there: its launches fail anyway)."""
    try:
        fd = os.open(state.lock, os.O_RDONLY)
    except OSError:
        return False  # no slot has started there yet
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # releases the probe's lock at once
    return False
