"""JSON lines (metrics.jsonl): the one reader and writer."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ddppipe.core import atomic


def read(path: str | Path) -> list[dict[str, Any]]:
    """The records of ``path`` ([] when absent); a torn last line (a killed writer) is skipped."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    records = []
    for line in text.splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def write(path: str | Path, records: Iterable[dict[str, Any]]) -> None:
    """Write ``records`` atomically, one JSON object per line."""
    atomic.write_text(path, "".join(json.dumps(r) + "\n" for r in records))
