"""Atomic file writes: a temporary file in the destination's folder, fsync, then rename."""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# The temporary files of atomic_path: .<destination name>.<mkstemp's random part>.tmp
_TEMP = re.compile(r"\.(.+)\.[a-z0-9_]+\.tmp")


@contextmanager
def atomic_path(dest: str | os.PathLike[str], durable: bool = True) -> Iterator[Path]:
    """Yield a temporary path next to ``dest``; on success it replaces ``dest`` atomically.

    On any exception the temporary file is removed and ``dest`` is left untouched; an OSError
    with an errno but no file name (a failed write) gets ``dest``'s. Not ``durable``: no fsync
    (readers still see the old file or the new one; a power loss may lose both): for files
    written again from others at will, many at a time.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    os.chmod(tmp, 0o666 & ~_umask())
    try:
        yield tmp
        if durable:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, dest)
        if durable:
            fsync_dir(dest.parent)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.errno is not None and e.filename is None:
            e.filename = str(dest)
        raise


def temp_target(name: str) -> str | None:
    """The destination name of :func:`atomic_path`'s temporary file ``name``, else None.

    A temporary file outlives its write only when the writing process was killed.
    """
    match = _TEMP.fullmatch(name)
    return match[1] if match else None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def fsync_dir(path: Path) -> None:
    """Make the entries of folder ``path`` (a rename into it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes(dest: str | os.PathLike[str], data: bytes, durable: bool = True) -> None:
    """Write ``data`` to ``dest`` atomically (``durable``: see :func:`atomic_path`)."""
    with atomic_path(dest, durable) as tmp:
        tmp.write_bytes(data)


def write_text(dest: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``dest`` atomically."""
    write_bytes(dest, text.encode())


def write_json(dest: str | os.PathLike[str], obj: Any) -> None:
    """Write ``obj`` as indented JSON to ``dest`` atomically."""
    write_text(dest, json.dumps(obj, indent=2, sort_keys=True) + "\n")
