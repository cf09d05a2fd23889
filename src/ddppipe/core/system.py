"""This process's machine: the CPUs it may use, the git commit of a work tree."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any


def available_cpus() -> int:
    """CPUs this process may use (SLURM's allocation on this node, or the affinity mask)."""
    if "SLURM_CPUS_ON_NODE" in os.environ:
        return int(os.environ["SLURM_CPUS_ON_NODE"])
    return len(os.sched_getaffinity(0))


def git_commit(cwd: Path | None = None) -> dict[str, Any]:
    """HEAD's commit and whether the work tree has uncommitted changes (None outside git)."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=cwd, capture_output=True, text=True, check=True, timeout=30
        ).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain"))}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
