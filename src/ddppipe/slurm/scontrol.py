"""What SLURM says about a job and its nodes (``scontrol``), and the job this process runs in:
its records, and what their fields mean (a node failed, the job's times)."""

from __future__ import annotations

import os
import re
import time

import hostlist

from ddppipe.core.errors import UserError
from ddppipe.slurm.runner import run


class ScontrolError(ValueError, UserError):
    """scontrol's answer lacks what was asked for."""


def job_id(env: dict[str, str] | None = None) -> str | None:
    """The SLURM job this process runs in, if any (inside an allocation or not)."""
    env = os.environ if env is None else env
    return env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")


def _scontrol(*args: str) -> str:
    return run(["scontrol", "-o", *args], check=True).stdout


def timestamp(text: str) -> float | None:
    """Unix time of a SLURM time (scontrol's and sacct's local ``2026-11-23T12:42:45``);
    None for Unknown, None or an empty field."""
    try:
        return time.mktime(time.strptime(text.strip(), "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def parse_record(line: str) -> dict[str, str]:
    """``Key=Value`` fields of one ``scontrol -o show`` line (values without spaces)."""
    return dict(m.groups() for m in re.finditer(r"(\w[\w:/]*)=(\S*)", line))


def job_record(job: str) -> dict[str, str]:
    """The job's ``scontrol -o show job`` fields (JobState, NodeList, EndTime, ...)."""
    return parse_record(_scontrol("show", "job", str(job)))


def job_nodes(job: str) -> list[str]:
    """Hosts of a SLURM job, in order, from ``scontrol show job`` (the job's NodeList)."""
    return parse_nodelist(_scontrol("show", "job", str(job)))


def parse_nodelist(scontrol_output: str) -> list[str]:
    """Expanded ``NodeList=`` of one ``scontrol -o show job`` line."""
    value = parse_record(scontrol_output).get("NodeList", "")
    if value and value != "(null)":
        return hostlist.expand_hostlist(value)
    raise ScontrolError(f"no NodeList in scontrol output: {scontrol_output.strip()[:200]!r}")


# A node's scontrol State is a base state and flags joined by "+" (SLURM 22.05: MIXED+DRAIN,
# DOWN+DRAIN+NOT_RESPONDING, IDLE+POWERED_DOWN). A failed node's processes are gone: down, not
# responding, powered down or powering down. A drained node's run on (DRAIN: administrators
# drain nodes with running jobs for maintenance, and draining waits for them), as do a node's
# that an administrator expects to fail (FAIL) and one asked to power down after its jobs
# (POWER_DOWN): neither makes a stop a node failure. A node drained by slurmd itself because a
# job's processes would not die (its Reason "Kill task failed") is failed for that job: read as
# the flag KILL_TASK_FAILED (:func:`node_states`).
KILL_TASK_FAILED = "KILL_TASK_FAILED"
FAILED_NODE_STATES = frozenset(
    {"DOWN", "NOT_RESPONDING", "POWERED_DOWN", "POWERING_DOWN", KILL_TASK_FAILED}
)


def node_states(nodes: list[str]) -> dict[str, str]:
    """Each node's ``State`` (e.g. ``MIXED``, ``DOWN+DRAIN``) from ``scontrol show node``; a
    drain of slurmd's own, its Reason ``Kill task failed``, adds the flag
    :data:`KILL_TASK_FAILED` (an administrator's drain, any other Reason, adds nothing)."""
    text = _scontrol("show", "node", hostlist.collect_hostlist(nodes))
    return dict(filter(None, map(parse_node_state, text.splitlines())))


KILL_TASK_REASON = "Kill task failed"  # slurmd's Reason for a node whose job would not die
REASON = re.compile(r"\bReason=(.*?)(?: \[[^\]@]*@[^\]]*\])?(?= \w[\w:/]*=|$)")


def parse_node_state(line: str) -> tuple[str, str] | None:
    """A ``scontrol -o show node`` line's node and state (:func:`node_states`). The Reason has
    spaces, then ``[user@time]``."""
    record = parse_record(line)
    if "NodeName" not in record:
        return None
    state = record.get("State", "")
    reason = REASON.search(line)
    if reason and reason.group(1).startswith(KILL_TASK_REASON):
        state += f"+{KILL_TASK_FAILED}"
    return record["NodeName"], state


def failed_nodes(nodes: dict[str, str]) -> list[str]:
    """The nodes of ``nodes`` (:func:`node_states`) that SLURM sees failed
    (:data:`FAILED_NODE_STATES`; a drained one is not), in their order."""
    flags = {n: {w.rstrip("*~#!%$@^-") for w in s.upper().split("+")} for n, s in nodes.items()}
    return [n for n, words in flags.items() if words & FAILED_NODE_STATES]


def ending(job: dict[str, str], nodes: dict[str, str]) -> bool:
    """Is SLURM ending the job (its scontrol record ``job``, its nodes' states ``nodes``)? Yes
    when a node of it failed or the job is no longer running (requeued, preempted, cancelled;
    an empty record, its query failed: scontrol's kill of the job reaches every process of
    it, scontrol's too)."""
    return bool(failed_nodes(nodes)) or job.get("JobState") != "RUNNING"


def seconds_left(job: dict[str, str], now: float | None = None) -> float | None:
    """Seconds until the job's EndTime (scontrol's local time), None when it has none."""
    end = timestamp(job.get("EndTime", ""))
    if end is None:
        return None
    return end - (time.time() if now is None else now)


def submitted(job: dict[str, str]) -> float | None:
    """Unix time of the job's SubmitTime (for a requeued job: its requeue); None if unknown."""
    return timestamp(job.get("SubmitTime", ""))


def started(job: dict[str, str]) -> float | None:
    """Unix time the job (this slot of it: a requeued job's latest) started; None if unknown."""
    return timestamp(job.get("StartTime", ""))


def queue_seconds(job: dict[str, str]) -> float:
    """How long this slot of the job waited: from its (re)submission or eligibility to start.

    A requeued job is eligible again from its requeue (EligibleTime); 0 when SLURM did not say.
    """
    start = started(job)
    since = [t for key in ("SubmitTime", "EligibleTime")
             if (t := timestamp(job.get(key, ""))) is not None]  # fmt: skip
    return max(0.0, start - max(since)) if start is not None and since else 0.0


def requeue(job: str) -> None:
    """``scontrol requeue JOB``: the job goes back to the queue, same id, a fresh time slot."""
    run(["scontrol", "requeue", str(job)], check=True)


def rename(job: str, name: str) -> None:
    """``scontrol update JobId=JOB JobName=NAME``."""
    run(["scontrol", "update", f"JobId={job}", f"JobName={name}"], check=True)


def config() -> str:
    """The cluster's ``scontrol show config`` (``Key = Value`` lines)."""
    return run(["scontrol", "show", "config"], check=True).stdout


def partitions() -> list[dict[str, str]]:
    """Every partition's ``scontrol -o show partition`` fields."""
    records = map(parse_record, _scontrol("show", "partition").splitlines())
    return [r for r in records if "PartitionName" in r]
