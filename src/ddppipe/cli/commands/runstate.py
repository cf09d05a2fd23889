"""The attempt-history subcommand: print a run's attempts, or write them as an HTML page."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from ddppipe.core import atomic
from ddppipe.reports import goodput
from ddppipe.runstate import attempts as ddp_attempts


def attempts(history: Path, run: str, html: Path | None) -> int:
    """``ddppipe attempts``: the table of ``history`` (attempts.json), each slot's goodput
    last, printed or as ``html``."""
    found = ddp_attempts.read(history)
    shares = goodput.shares([asdict(a) for a in found])
    if html:
        atomic.write_text(html, ddp_attempts.html_table(found, run, shares))
    else:
        print(ddp_attempts.table(found, shares))
    return 0
