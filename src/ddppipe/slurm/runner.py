"""SLURM's commands (sbatch, squeue, scontrol, sacct, scancel) run one way: their output
captured as text, each under a time limit."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence

TIMEOUT_S = 60.0


def run(
    argv: Sequence[str], timeout: float = TIMEOUT_S, check: bool = False
) -> subprocess.CompletedProcess[str]:
    """Run a SLURM command; TimeoutExpired past ``timeout``, CalledProcessError when it fails
    and ``check``."""
    return subprocess.run(list(argv), capture_output=True, text=True, check=check, timeout=timeout)
