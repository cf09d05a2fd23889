"""After training stopped on a signal: why, and whether the job goes on in a new slot.

A stop on the time-limit warning (the launcher's SIGUSR1) or on a user's ``scancel --signal``
continues by requeueing the job itself (``scontrol requeue``, as submitit and Lightning do):
the same job id goes back to the queue and gets a fresh time slot, and the Snakemake SLURM
plugin, which sees a PENDING or RUNNING job, keeps waiting; its ``retries`` stay for real
failures. Preemption and node failures are requeued by SLURM itself (``--requeue``). A slot
that checkpointed no new step, or a run past ``slurm.max_continuations``, fails instead of
looping.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ddppipe.runstate import outcomes
from ddppipe.runstate.attempts import Attempt
from ddppipe.runstate.outcomes import Kind, Outcome
from ddppipe.slurm import scontrol

# The warning arrives signal_seconds before the end; the stop then takes some seconds more.
TIME_LIMIT_SLACK_S = 30
# States of a job that SLURM has put back in the queue (its nodes' states may be unknown).
REQUEUED_STATES = ("PENDING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD")
# A node's scontrol State is a base state and flags joined by "+" (SLURM 22.05: MIXED+DRAIN,
# DOWN+DRAIN+NOT_RESPONDING, IDLE+POWERED_DOWN). A failed node's processes are gone: down, not
# responding, powered down or powering down. A drained node's run on (DRAIN: administrators
# drain nodes with running jobs for maintenance, and draining waits for them), as do a node's
# that an administrator expects to fail (FAIL) and one asked to power down after its jobs
# (POWER_DOWN): neither makes a stop a node failure.
FAILED_NODE_STATES = frozenset({"DOWN", "NOT_RESPONDING", "POWERED_DOWN", "POWERING_DOWN"})
# The outcome of a stop whose job SLURM could not say (its query failed): not a time limit, not a
# user's signal either.
UNKNOWN_CAUSE = "cause unknown: scontrol show job failed"


def ending(job: dict[str, str], nodes: dict[str, str]) -> bool:
    """Is SLURM ending the job of a step that exited 0 without every node's finished mark?

    Yes when a node of it failed (``DOWN+DRAIN``, ``NOT_RESPONDING``: srun exits 0 on a node
    failure) or the job is no longer running (requeued, preempted, cancelled), from its
    scontrol record ``job`` and its nodes' states ``nodes``. Otherwise the marks are late
    (a shared filesystem that shows other nodes' files after a while) and the exit 0 stands.
    """
    return bool(_nodes_in(nodes, FAILED_NODE_STATES)) or job.get("JobState") != "RUNNING"


def failed_nodes(nodes: dict[str, str]) -> list[str]:
    """The nodes of ``nodes`` (scontrol states) that SLURM sees failed: down, not responding,
    powered down (:data:`FAILED_NODE_STATES`; a drained one is not)."""
    return _nodes_in(nodes, FAILED_NODE_STATES)


def _nodes_in(nodes: dict[str, str], states: frozenset[str]) -> list[str]:
    """The nodes whose scontrol ``State`` (e.g. ``DOWN+DRAIN``) has one of ``states`` as its
    base state or a flag (whole words: ``POWER_DOWN`` is not ``DOWN``; sinfo's marks such as
    ``down*`` ignored)."""
    return [n for n, state in nodes.items()
            if {w.rstrip("*~#!%$@^-") for w in state.upper().split("+")} & states]  # fmt: skip


def seconds_left(job: dict[str, str], now: float | None = None) -> float | None:
    """Seconds until the job's EndTime (scontrol's local time), None when it has none."""
    end = scontrol.timestamp(job.get("EndTime", ""))
    if end is None:
        return None
    return end - (time.time() if now is None else now)


def submitted(job: dict[str, str]) -> float | None:
    """Unix time of the job's SubmitTime (for a requeued job: its requeue); None if unknown."""
    return scontrol.timestamp(job.get("SubmitTime", ""))


def started(job: dict[str, str]) -> float | None:
    """Unix time the job (this slot of it: a requeued job's latest) started; None if unknown."""
    return scontrol.timestamp(job.get("StartTime", ""))


def queue_seconds(job: dict[str, str]) -> float:
    """How long this slot of the job waited: from its (re)submission or eligibility to start.

    A requeued job is eligible again from its requeue (EligibleTime); 0 when SLURM did not say.
    """
    start = scontrol.timestamp(job.get("StartTime", ""))
    since = [t for key in ("SubmitTime", "EligibleTime")
             if (t := scontrol.timestamp(job.get(key, ""))) is not None]  # fmt: skip
    return max(0.0, start - max(since)) if start is not None and since else 0.0


def lost(nodes: dict[str, str], requeued: bool) -> Outcome | None:
    """How a slot whose launcher was killed before it could say ended, as SLURM tells it at
    the next slot: its nodes' states ``nodes`` (a node failed: "node failure", the launcher
    died with it; a drained one alone kills no launcher, nor one expected to fail), or its
    job ``requeued`` since (same job, more restarts); None when SLURM says neither."""
    if _nodes_in(nodes, FAILED_NODE_STATES):
        return Outcome(Kind.NODE_FAILURE)
    return Outcome(Kind.REQUEUED_BY_SLURM) if requeued else None


def classify(
    signal_name: str | None,
    job: dict[str, str] | None,
    nodes: dict[str, str],
    signal_seconds: int,
    now: float | None = None,
    stop_signal: str = "SIGUSR1",
) -> Outcome:
    """How a slot that stopped on ``signal_name`` ended, from what SLURM says right after.

    ``job`` is the job's scontrol record (None outside SLURM; empty: its query failed, the
    cause is unknown), ``nodes`` its nodes' states (a drained node is no failure).
    """
    signal_name = signal_name or "a signal"
    if job is None:
        return outcomes.stopped(signal_name)
    if _nodes_in(nodes, FAILED_NODE_STATES):
        return Outcome(Kind.NODE_FAILURE)
    if not job:
        return outcomes.stopped(signal_name, UNKNOWN_CAUSE)
    if job.get("JobState") == "PREEMPTED" or "preempt" in job.get("Reason", "").lower():
        return Outcome(Kind.PREEMPTED)
    if job.get("JobState") in REQUEUED_STATES:
        return Outcome(Kind.REQUEUED_BY_SLURM)
    left = seconds_left(job, now)
    near_end = left is not None and left <= signal_seconds + TIME_LIMIT_SLACK_S
    if signal_name == stop_signal and near_end:
        return Outcome(Kind.TIME_LIMIT)
    return outcomes.stopped(signal_name)


@dataclass(frozen=True)
class Decision:
    """Whether the job should requeue itself, and why not when it should not."""

    requeue: bool
    reason: str


def decide(history: list[Attempt], max_continuations: int) -> Decision:
    """Requeue after the last slot of ``history`` (which stopped on a signal)?

    A slot whose progress is unknown (a script that logged no step) continues, bounded by
    ``max_continuations``. A slot that hung without checkpointing a new step continues once;
    a second such slot in a row fails the run. A slot that went on in its job after a lost
    node (:func:`after_lost_node`) continues too: its time was what the lost slot left.
    """
    last = history[-1]
    if last.kind in outcomes.REQUEUED_BY_SLURM:
        return Decision(False, f"{last.outcome}: SLURM requeues the job itself")
    if last.kind is Kind.HUNG and last.steps <= 0:  # (ddppipe.launching.watchdog)
        before = history[-2] if len(history) > 1 else None
        if before is not None and before.kind is Kind.HUNG and before.steps <= 0:
            return Decision(
                False,
                f"slots {before.number} and {last.number} hung without checkpointing a new "
                "step: not continuing. The attempt history names the ranks and frames, the "
                "state folder's hangs/ has every rank's stack",
            )  # one more slot after a hang without progress, which may have been transient
    elif last.start_step is not None and last.steps <= 0 and not after_lost_node(history):
        return Decision(
            False,
            f"no progress: slot {last.number} (job {last.job}) checkpointed no new step "
            f"(it resumed from {last.resumed_from or 'the start'}). The time left after "
            "start-up is too short for one checkpoint interval: raise slurm.runtime, or lower "
            "slurm.signal_seconds if the warning comes long before the checkpoint is needed",
        )
    requeues = sum(1 for a in history[:-1] if a.job == last.job)
    if requeues >= max_continuations:
        return Decision(
            False,
            f"slurm.max_continuations ({max_continuations}) reached: job {last.job} ran "
            f"{requeues + 1} slots; raise slurm.max_continuations or slurm.runtime",
        )
    return Decision(True, "")


def after_lost_node(history: list[Attempt]) -> bool:
    """Did the last slot of ``history`` go on in its job (the same job and restart) after the
    slot before it lost a node (``slurm.spare_nodes``, ``slurm.min_nodes``)?"""
    if len(history) < 2:
        return False
    before, last = history[-2], history[-1]
    same_slot_of_job = (before.job, before.restarts) == (last.job, last.restarts)
    return same_slot_of_job and before.kind is Kind.NODE_FAILURE
