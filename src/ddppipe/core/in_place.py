"""A small record rewritten in place, for a reader on another node of a shared filesystem."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def write_padded(path: Path, data: bytes, size: int) -> bool:
    """Write ``data`` padded to ``size`` bytes (so a shorter record overwrites a longer one)
    over the start of ``path``, in place, then close it: a shared filesystem shows it to
    another node at its next open (close-to-open), where a renamed file could stay hidden
    behind that node's cached directory. False, nothing raised, when it could not be written
    (a full disk must not stop a training)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.pwrite(fd, data.ljust(size), 0)
        finally:
            os.close(fd)
        return True
    return False
