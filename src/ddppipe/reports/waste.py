"""Waste flags: an attempt's figures judged at the thresholds centres use, in plain words, each
with its fix (the summary's ``waste`` lines).

The ranks measure (:mod:`ddppipe.training.measuring.efficiency`); this module judges.
"""

from __future__ import annotations

from typing import Any

from ddppipe.runstate import outcomes
from ddppipe.runstate.outcomes import Kind
from ddppipe.slurm import memory_request

MEMORY_USED_BELOW = 0.70  # of the request: centres flag (seff, jobstats) and so does ddppipe
TIME_LIMIT_USED_BELOW = 0.10
CPU_EFFICIENCY_BELOW = 0.50
STARTUP_SHARE_ABOVE = 0.50  # of a slot's wall time
GPU_UTILISATION_BELOW = 0.25  # NVML's mean: centres' idle-GPU threshold (Job Defense Shield)
DATA_WAIT_SHARE_ABOVE = 0.20  # of the steady steps' time: the steps wait for their data


def cpu_efficiency(cpu_s: float, wall_s: float, cpus: int) -> float | None:
    """The share of ``cpus`` CPUs busy over ``wall_s``; None without a wall time or CPUs."""
    return cpu_s / (wall_s * cpus) if wall_s > 0 and cpus > 0 else None


def flags(attempt: dict[str, Any], mem_mb: int | None, runtime_min: int | None,
          cpus: int, mem_sized: bool = False) -> list[str]:  # fmt: skip
    """Plain-words waste warnings for one attempt record, each with its fix (``mem_mb``: a
    node's request; ``mem_sized``: ddppipe's own, ``slurm.mem_mb`` null, which the run's next
    job sizes from the peak by itself). A memory peak near or above the request is flagged
    too: not waste, the risk of the OOM killer."""
    found: list[str] = []
    eff = attempt.get("efficiency") or {}
    wall = (attempt.get("end") or 0) - attempt.get("start", 0)
    peak = eff.get("memory_peak_mb")
    if mem_mb and peak and peak < MEMORY_USED_BELOW * mem_mb:
        suggest = memory_request.from_peak_mb(peak)
        fix = (f"the run's next job asks for {suggest} MB (its peak and a quarter: "
               "`slurm.mem_mb` is null)" if mem_sized
               else f"ask for {suggest} MB: `slurm.mem_mb: {suggest}`")  # fmt: skip
        found.append(
            f"memory: the fullest node peaked at {peak:,.0f} MB of the {mem_mb:,} MB requested "
            f"({peak / mem_mb:.0%}); {fix}"
        )
    if mem_mb and peak and peak >= memory_request.NEAR_LIMIT * mem_mb:
        suggest = memory_request.from_peak_mb(peak)
        where = "above" if peak > mem_mb else "within 10 % of"
        found.append(
            f"memory: the fullest node peaked at {peak:,.0f} MB, {where} the {mem_mb:,} MB "
            f"requested ({peak / mem_mb:.0%}): a cluster that enforces the request (cgroup) "
            f"kills the job there; ask for {suggest} MB: `slurm.mem_mb: {suggest}` (or leave "
            "it null: the run's next job asks for its measured peak and a quarter)"
        )
    if runtime_min and outcomes.kind_of(attempt) is Kind.COMPLETED and wall > 0:
        share = wall / (runtime_min * 60)
        if share < TIME_LIMIT_USED_BELOW:
            minutes = max(1, int(wall * 2 // 60) + 1)
            found.append(
                f"time limit: the slot used {share:.0%} of its {runtime_min} min; a shorter "
                f"limit starts sooner: `slurm.runtime: {minutes}`"
            )
    busy = eff.get("gpu_utilisation")
    if busy is not None and busy < GPU_UTILISATION_BELOW:
        found.append(
            f"GPU: the GPUs were busy {busy:.0%} of the training (NVML); feed them more work a "
            "step (`train.batch_size`), or ask for fewer GPUs (`launch.nproc_per_node`)"
        )
    waited = eff.get("data_wait_share")
    if waited is not None and waited > DATA_WAIT_SHARE_ABOVE:
        found.append(
            f"data: the steps waited {waited:.0%} of the training for their batches; read "
            "them faster: more DataLoader workers (`launch.loader_workers`), or the data "
            "packed into one file, decoded once (imagefolder's `pack: true`), or streamed "
            "from shards (docs/data.md); `ddppipe time-loader` times the loader alone"
        )
    startup = eff.get("startup_s", 0.0)
    if wall > 0 and startup > STARTUP_SHARE_ABOVE * wall:
        found.append(
            f"start-up: {startup:.0f} s of the slot's {wall:.0f} s passed before the first step "
            "(torchrun, rendezvous, checks, data): the fewer and longer the slots, the less "
            "of it (`slurm.runtime`, `train.epochs`)"
        )
        return found  # the CPUs idled while it started: that is the waste to fix first
    efficiency = cpu_efficiency(eff.get("cpu_s", 0.0), wall, cpus) if eff else None
    if efficiency is not None and efficiency < CPU_EFFICIENCY_BELOW:
        found.append(
            f"CPU: {efficiency:.0%} of the {cpus} CPUs allocated were busy over the slot; "
            "fewer CPUs per process (`launch.cpus_per_proc`) or more processes would use them"
        )
    return found
