"""A signal to every process of a SLURM step, on every node (``scancel --signal``)."""

from __future__ import annotations

import signal

from ddppipe.slurm.runner import run

TIMEOUT_S = 30.0


def send(step: str, sig: signal.Signals) -> str | None:
    """Send ``sig`` to the step ``step`` (JOB.STEP); scancel's error, or None when it went."""
    # By number: Slurm 22.05's scancel knows the names of a few signals only (not WINCH).
    result = run(["scancel", f"--signal={int(sig)}", step], timeout=TIMEOUT_S)
    return result.stderr.strip() if result.returncode != 0 else None
