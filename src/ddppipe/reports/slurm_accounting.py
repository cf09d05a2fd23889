"""SLURM's accounting of a run's jobs in the summary: asked once (``sacct``, on the submitting
machine, :mod:`ddppipe.slurm.accounting`), set beside the ranks' own figures, the time the
run's times count from (its first submission), and a killed rank named out of memory where
SLURM's memory limit killed it (sacct's ``OUT_OF_MEMORY``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict
from typing import Any

from ddppipe.reports.wording import duration
from ddppipe.runstate import failures, out_of_memory, outcomes
from ddppipe.runstate.outcomes import Kind
from ddppipe.slurm import accounting

MIB = 1024**2  # sacct's "MB" (accounting.size_mb)


def records(jobs: list[str]) -> list[accounting.Record] | None:
    """sacct's records of the SLURM jobs ``jobs``; None for a local run (no jobs)."""
    return accounting.query(jobs) if jobs else None


def origin(
    attempts: list[dict[str, Any]], found: list[accounting.Record] | None
) -> tuple[float, str] | None:
    """(Unix time, name) the run's times count from: its first SLURM submission (sacct's
    Submit, else scontrol's, which the first slot recorded), else its first slot's start."""
    submits = [r.submit for r in found or [] if r.submit is not None]
    if attempts and attempts[0].get("submitted") is not None:
        submits.append(attempts[0]["submitted"])
    if submits:
        return min(submits), "first submission"
    return (attempts[0]["start"], "first slot's start") if attempts else None


def out_of_memory_named(
    attempts: list[dict[str, Any]], found: list[accounting.Record] | None
) -> list[dict[str, Any]]:
    """``attempts`` with each slot that a killed rank ended named out of memory where sacct
    says SLURM's memory limit killed a task of it (its job and requeue ``OUT_OF_MEMORY``)."""
    killed = {(r.job, r.requeue): r for r in found or [] if r.out_of_memory}
    named = []
    for attempt in attempts:
        record = killed.get((str(attempt.get("job")), attempt.get("restarts", 0)))
        named.append(_named(attempt, record) if record and _killed(attempt) else attempt)
    return named


def _killed(attempt: dict[str, Any]) -> bool:
    """Did a signal kill the slot's first failing rank, not known to be out of memory?"""
    return outcomes.kind_of(attempt) is Kind.KILLED


def _named(attempt: dict[str, Any], record: accounting.Record) -> dict[str, Any]:
    """The slot ``attempt`` out of memory, with sacct's figures (the rest of its detail kept:
    ``(slots 2 and 3 failed the same way: not retried)``)."""
    before = failures.Failure(**attempt["failure"])
    per_node = record.req_mem_mb / record.nodes if record.req_mem_mb and record.nodes else None
    figures = out_of_memory.slurm_figures(
        int(record.max_rss_mb * MIB) if record.max_rss_mb else None,
        int(per_node * MIB) if per_node else None,
    )
    failure = failures.Failure(**{**asdict(before), "memory": figures})
    rest = attempt.get("detail", "").removeprefix(before.cause())
    return {**attempt, "outcome": failure.outcome().label,
            "detail": failure.cause() + rest, "failure": asdict(failure)}  # fmt: skip


def line(attempts: list[dict[str, Any]], found: list[accounting.Record] | None) -> tuple[str, str]:
    """SLURM's accounting of the run's jobs beside the ranks' own figures, where both exist."""
    if not found:
        return accounting.NAME, "no SLURM accounting: own measurements"
    jobs = len({r.job for r in found})
    requeues = len(found) - jobs
    states = ", ".join(f"{n} {state}" for state, n in Counter(r.state for r in found).items())
    parts = [f"{len(found)} job record(s) ({jobs} job(s), {requeues} requeue(s)): {states}"]
    own = [a["efficiency"] for a in attempts if a.get("efficiency")]
    held = [r.cpu_hours for r in found if r.cpu_hours is not None]
    if held:
        parts.append(f"{sum(held):,.3f} CPU-hours allocated")
    cpu = [r.total_cpu_s for r in found if r.total_cpu_s is not None]
    if cpu:
        mine = f" (the ranks' own {duration(sum(e.get('cpu_s', 0.0) for e in own))})"
        parts.append(f"TotalCPU {duration(sum(cpu))}" + (mine if own else ""))
    rss = [r.max_rss_mb for r in found if r.max_rss_mb is not None]
    if rss:
        memory = f"MaxRSS {max(rss):,.0f} MB a task"
        asked = [r.req_mem_mb / r.nodes for r in found if r.req_mem_mb and r.nodes]
        if asked:
            memory += f" of ReqMem {max(asked):,.0f} MB a node"
        if own:
            memory += f" (own peak {max(e.get('memory_peak_mb', 0.0) for e in own):,.0f} MB a node)"
        parts.append(memory)
    queued = [r.queue_s for r in found if r.queue_s is not None]
    if queued:
        mine = [a["queue_s"] for a in attempts if a.get("queue_s") is not None]
        own_queue = f" (own {duration(sum(mine))})" if mine else ""
        parts.append(f"queued {duration(sum(queued))}{own_queue}")
    return accounting.NAME, "; ".join(parts)
