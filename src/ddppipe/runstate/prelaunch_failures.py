"""Jobs of a run that failed before its launcher started: their errors, in the state folder.

A training job on SLURM runs the rule inside a Snakemake of its own (the plugin's job step):
that Snakemake parses the workflow again, checks the rule's inputs and then runs
``ddppipe launch``. When it fails before the launcher opened an attempt (a config error, a
file the node does not see, an import error, the command missing on the node), no attempt
names it; the submitting Snakemake records the error it found in the job's log here
(``<state>/early-failures.json``, :mod:`ddppipe.slurm.executor.early_failures`), so that the run's
summary and the sweep's table name it, and a second identical failure is not retried.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from ddppipe.core import atomic
from ddppipe.runstate.state import StateDir


@dataclass(frozen=True)
class EarlyFailure:
    """A job that failed before the launcher started."""

    job: str  # the SLURM job id
    time: float  # Unix time the submitting Snakemake saw it fail
    error: str  # the error's first line, as the job's log has it
    log: str | None  # the job's log

    def text(self) -> str:
        """``before training (SLURM job 15): <error> (log: <path>)``."""
        where = f" (log: {self.log})" if self.log else ""
        return f"before training (SLURM job {self.job}): {self.error}{where}"


def path(state: StateDir) -> Path:
    return state.early_failures


def load(state: StateDir) -> list[EarlyFailure]:
    """The run's early failures, oldest first; none when the file is missing or unreadable."""
    try:
        records = json.loads(path(state).read_text())
        return [EarlyFailure(**r) for r in records]
    except (OSError, ValueError, TypeError):
        return []


def record(state: StateDir, failure: EarlyFailure) -> list[EarlyFailure]:
    """Add ``failure`` to the run's record (written atomically); the whole record."""
    found = [*load(state), failure]
    atomic.write_json(path(state), [asdict(f) for f in found])
    return found


def latest(failures: Sequence[EarlyFailure], starts: Sequence[float]) -> EarlyFailure | None:
    """The run's last early failure, when no slot started after it (``starts``: the Unix times
    its slots started; a slot that trained since tells the run's story: its attempt's
    outcome)."""
    if not failures:
        return None
    last = failures[-1]
    return None if any(start > last.time for start in starts) else last


def repeated(failures: Sequence[EarlyFailure], starts: Sequence[float]) -> bool:
    """Whether the last two early failures had the same error with no slot started between
    them or since (``starts``: the slots' start times): the rule of every restart budget (a
    second identical failure is final: :data:`ddppipe.runstate.restarts.SAME_TWICE`) before
    training."""
    if len(failures) < 2 or latest(failures, starts) is None:
        return False
    before, last = failures[-2], failures[-1]
    return before.error == last.error and not any(before.time < s < last.time for s in starts)
