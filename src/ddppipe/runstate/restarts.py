"""Which restart budget covers which fault, and when a failure ends the run: one table.

The local worker group (:mod:`ddppipe.launching.workers`), the launcher
(:mod:`ddppipe.launching.slot_machine`) and the SLURM executor's record of jobs that failed
before training (:mod:`ddppipe.runstate.prelaunch_failures`) all go by it, locally, in a packed
slot and on SLURM alike; ``docs/training.md`` shows it (a test checks the two agree).
"""

from __future__ import annotations

from dataclasses import dataclass

from ddppipe.runstate.failures import Failure


@dataclass(frozen=True)
class Budget:
    """One restart budget: its ``name``, the ``setting`` that sizes it, the ``faults`` it
    covers and ``who`` restarts."""

    name: str
    setting: str
    faults: str
    who: str


RESTARTS = (
    Budget("in-job continuation", "slurm.spare_nodes, slurm.min_nodes",
           "a node lost mid-step; a node that fails its own checks",
           "the launcher: a next step in the same job, a spare or fewer nodes"),
    Budget("the job's own requeue", "slurm.max_continuations",
           "the time-limit warning; a user's stop signal; a hang (a second without progress "
           "ends the run)", "the launcher: scontrol requeue, the same job id"),
    Budget("SLURM's requeue", "sbatch --requeue",
           "preemption; a node failure; SLURM ending the job", "SLURM"),
    Budget("Snakemake's retry", "retries (the SLURM profile)",
           "a job that failed before training; a slot that failed; a requeue refused",
           "Snakemake: a new job"),
    Budget("the worker group's restart", "launch.max_restarts",
           "a rank's crash (the local worker group, torchrun's agent on SLURM)",
           "the worker group, in the same slot"),
)  # fmt: skip
# What every budget shares: a failure that cannot pass on a retry ends the run at once.
SAME_TWICE = "the same failure twice in a row ends the run; a non-finite loss at once"


def repeats(now: Failure, before: Failure | None) -> bool:
    """Is ``now`` the failure ``before`` was (same exception, user frame and step)? Not for a
    rank killed at no known step (the kill, not the code) or a failed rendezvous (the nodes',
    not the code's: other nodes may meet)."""
    if before is None or now.rendezvous or (now.signal and now.step is None):
        return False
    return before.signature == now.signature


def ends_run(now: Failure, before: Failure | None, number: int, what: str = "slots") -> str | None:
    """Why the failure ``now`` of slot number ``number`` (``what``: or the worker group's
    start) ends the run for good (``before``: the one before it, if any), or None: a
    non-finite loss, or the same failure twice in a row."""
    if now.nonfinite:
        return "the loss was not finite"
    if repeats(now, before):
        return f"{what} {number - 1} and {number} failed the same way"
    return None
