"""What SLURM queues or runs (``squeue``): a job's steps, jobs' states, and this user's jobs
(one read serving the calls of a few seconds)."""

from __future__ import annotations

import getpass
import re
import time
from dataclasses import dataclass
from pathlib import Path

from ddppipe.slurm.runner import run

MINE_FORMAT = "%i|%T|%j|%k|%Z"  # job id, state, name, comment, working directory
MINE_MAX_AGE_S = 5.0  # a head's train jobs, asked for one after another, share one read
STEPS_TIMEOUT_S = 30.0
_mine: dict[str, tuple[float, list[Queued]]] = {}  # "": (monotonic time read, the jobs)


@dataclass(frozen=True)
class Queued:
    """One of this user's jobs as squeue shows it."""

    job: str
    state: str
    name: str
    comment: str
    workdir: Path


def parse(text: str) -> list[Queued]:
    """The jobs of ``squeue -o MINE_FORMAT`` output."""
    rows = (line.strip().split("|") for line in text.splitlines())
    return [Queued(job, state, name, comment, Path(workdir))
            for job, state, name, comment, workdir in (r for r in rows if len(r) == 5)]  # fmt: skip


def mine(max_age_s: float = MINE_MAX_AGE_S) -> list[Queued]:
    """This user's queued and running jobs, read anew when the last read is older than
    ``max_age_s``; OSError or SubprocessError when squeue fails."""
    now = time.monotonic()
    if "" not in _mine or now - _mine[""][0] > max_age_s:
        out = run(["squeue", "-h", "-u", getpass.getuser(), "-o", MINE_FORMAT], check=True)
        _mine[""] = (now, parse(out.stdout))
    return _mine[""][1]


def steps(job: str) -> list[str]:
    """The steps (``JOB.STEP``) of ``job`` that SLURM runs; none when squeue fails."""
    out = run(["squeue", "-h", "-s", "-j", job, "-o", "%i"], timeout=STEPS_TIMEOUT_S).stdout
    return [s for s in out.split() if re.fullmatch(rf"{job}\.\d+", s)]


def states(jobs: list[str]) -> dict[str, str]:
    """The state (PENDING, RUNNING, ...) of each of ``jobs`` squeue still shows; none when
    squeue fails."""
    out = run(["squeue", "--noheader", "--format=%i %T", f"--jobs={','.join(jobs)}"]).stdout
    rows = (line.split() for line in out.splitlines())
    return {f[0]: f[1] for f in rows if len(f) == 2}
