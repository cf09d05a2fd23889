"""``ddppipe reproduce``: train a finished run again and say whether it came out the same."""

from __future__ import annotations

from pathlib import Path


def reproduce(path: Path, data: Path | None) -> int:
    """``ddppipe reproduce PATH`` (:mod:`ddppipe.reproduce.command`)."""
    from ddppipe.reproduce import command

    return command.reproduce(path, data)
