"""Utilisation: an attempt's achieved FLOP/s against its allocation's compute peak, in words.

The peak is the GEMM its ranks' checks measured on the attempt's nodes (SLURM runs), else the GPUs'
datasheet (:mod:`ddppipe.training.measuring.peak`); a CPU without a measured peak gets no fraction.
"""

from __future__ import annotations

from typing import Any

from ddppipe.training.measuring import peak

NO_PEAK = "no peak to compare with: a SLURM slot's checks measure it, or a known GPU"


def utilisation(
    attempt: dict[str, Any], precision: str, processes: int
) -> tuple[float, str] | None:
    """The attempt's achieved FLOP/s as a fraction of its allocation's peak, and the peak's
    source: the preflight's GEMM on its nodes, else the GPUs' datasheet; None without either.
    ``precision``: the run's, unless the attempt recorded what its ranks decided it was."""
    precision = (attempt.get("precision") or {}).get("trained", precision)
    eff = attempt.get("efficiency") or {}
    achieved = eff.get("achieved_gflops")
    if not achieved:
        return None
    measured = (attempt.get("peak") or {}).get("gflops") or {}
    nodes = [measured[n] for n in attempt.get("nodes", []) if n in measured]
    if nodes and len(nodes) == len(attempt.get("nodes", [])):
        total = sum(nodes)
        return achieved / total, f"{total:,.0f} GFLOP/s {precision} GEMM peak, measured"
    per_gpu = peak.gpu_datasheet_gflops(eff.get("gpu_name") or "", precision)
    if per_gpu:
        total = per_gpu * processes
        return achieved / total, f"{total:,.0f} GFLOP/s {precision}, {eff['gpu_name']} datasheet"
    return None


def describe(attempt: dict[str, Any], precision: str, processes: int) -> str:
    """The summary's ``utilisation`` line: the fraction of the peak and its source."""
    found = utilisation(attempt, precision, processes)
    if found is None:
        return NO_PEAK
    fraction, source = found
    return f"{fraction:.0%} of the peak ({source})"
