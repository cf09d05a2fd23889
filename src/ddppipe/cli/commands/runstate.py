"""The attempt-history subcommand: print a run's attempts, or write them as an HTML page."""

from __future__ import annotations

from pathlib import Path

from ddppipe.core import atomic
from ddppipe.runstate import attempts as ddp_attempts


def attempts(history: Path, run: str, html: Path | None) -> int:
    """``ddppipe attempts``: the table of ``history`` (attempts.json), printed or as ``html``."""
    found = ddp_attempts.read(history)
    if html:
        atomic.write_text(html, ddp_attempts.html_table(found, run))
    else:
        print(ddp_attempts.table(found))
    return 0
