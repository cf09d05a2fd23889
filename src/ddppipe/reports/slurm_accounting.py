"""SLURM's accounting of a run's jobs in the summary: asked once (``sacct``, on the submitting
machine, :mod:`ddppipe.slurm.accounting`), set beside the ranks' own figures, and the time
the run's times count from (its first submission).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from ddppipe.reports.wording import duration
from ddppipe.slurm import accounting


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


def line(attempts: list[dict[str, Any]], found: list[accounting.Record] | None) -> tuple[str, str]:
    """SLURM's accounting of the run's jobs beside the ranks' own figures, where both exist."""
    if not found:
        return "sacct", "no SLURM accounting: own measurements"
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
    return "sacct", "; ".join(parts)
