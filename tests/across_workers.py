"""Work that two pytest workers (pytest-xdist, ``make test``) share: done once, by the first
worker that needs it, under a lock in the run's base folder; the other waits for it and reads
its record. Without workers it is done in the session's own base folder."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

RECORD = "done.json"


def shared_root(factory: pytest.TempPathFactory) -> Path:
    """The folder every worker of this run sees: the workers' common base (``popen-gwN``'s
    parent) under pytest-xdist, the session's base folder otherwise."""
    base = factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (created) for the block, across processes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def once(factory: pytest.TempPathFactory, name: str,
         make: Callable[[Path], dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
    """``make(folder)``'s record (JSON), made once in ``<shared root>/<name>`` by whichever
    worker comes first; a worker that comes later gets the record it wrote."""
    folder = shared_root(factory) / name
    with locked(folder.with_name(f"{name}.lock")):
        record = folder / RECORD
        if record.is_file():
            return json.loads(record.read_text())
        folder.mkdir(parents=True, exist_ok=True)
        found = make(folder)
        draft = record.with_name(f".{RECORD}.{os.getpid()}")
        draft.write_text(json.dumps(found))
        os.replace(draft, record)
        return found
