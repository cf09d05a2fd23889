"""The memory a training job asks for a node when ``slurm.mem_mb`` is null (``--mem``).

Before a run's first slot it is estimated from what its processes hold; once a slot of the run
measured its peak (the fullest node's, as the job's cgroup counts it: its attempt record,
:mod:`ddppipe.training.measuring.efficiency`), later submissions ask for that peak instead
(after a slot the OOM killer killed at its request: for more than that request).
Both with the same margin (:data:`HEADROOM`): a cluster that enforces the request
(``ConstrainRAMSpace``) kills a job whose node goes above it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

# A node's processes share the libraries they map (torch's, Python's) once: 537 MB of
# file-backed pages in a CPU rank with DDP and gloo set up (RssFile, torch 2.x, 2026-11-28).
SHARED_MB = 550
# One CPU training process of the default run at its peak, without those libraries, in fp32:
# what train.precision auto trains in on a CPU without bfloat16 (AVX2), and the most a CPU
# process of it holds. Measured 2026-11-29, real MNIST, 2 ranks a node on the SLURM test
# cluster (2-core AMD EPYC) with torch's kernels capped at AVX2: the node's peak 2,378 MB
# alone, 2,668 MB beside the other tests (in bf16 2,119-2,238 MB; locally 2,508 in fp32 and
# 2,332 in bf16): the interpreter, torch,
# ddppipe, gloo and DDP about 370 MB; MNIST held as tensors about 135 MB; the model's states
# (parameters, gradients, AdamW's two moments) 19 MB; its training and evaluation batches'
# activations and the allocator's slack the rest.
CPU_PROCESS_MB = 1060
# A GPU process also holds its CUDA context, cuDNN, cuBLAS and NCCL on the host (docs/gpus.md).
GPU_PROCESS_MB = 8000
MIN_GPU_PROCESS_MB = 4000  # the least a GPU process needs: a request below it is refused
HEADROOM = 1.25  # the margin over an estimate or a measured peak
NEAR_LIMIT = 0.90  # a peak at or above this share of its request is flagged (reports.waste)
STEP_MB = 100


def _rounded(mb: float) -> int:
    """``mb`` rounded up to :data:`STEP_MB`."""
    return int(math.ceil(mb / STEP_MB) * STEP_MB)


def estimated_mb(procs_per_node: int, gpus: bool) -> int:
    """A node's request before any slot measured: :data:`GPU_PROCESS_MB` a GPU process, else
    the libraries once and :data:`CPU_PROCESS_MB` a process, with the margin."""
    if gpus:
        return procs_per_node * GPU_PROCESS_MB
    return _rounded((SHARED_MB + procs_per_node * CPU_PROCESS_MB) * HEADROOM)


def from_peak_mb(peak_mb: float) -> int:
    """A node's request for a measured node peak of ``peak_mb``: the peak with the margin."""
    return _rounded(peak_mb * HEADROOM)


def measured_peak_mb(history: Iterable[Any], procs_per_node: int) -> float | None:
    """The node peak the run's last measured slot recorded (``history``: its attempt
    records, :class:`ddppipe.runstate.attempts.Attempt`), if it ran ``procs_per_node``
    processes a node (a slot of another shape says nothing of this one); None otherwise. A
    slot the OOM killer killed under its job's request (its ``mem_mb``) measured nothing, but
    needed more than that request: the request counts as its peak."""
    for attempt in reversed(list(history)):
        peak = (attempt.efficiency or {}).get("memory_peak_mb")
        killed = ((attempt.failure or {}).get("memory") or {}).get("oom_killer")
        if not peak and killed and attempt.mem_mb:
            peak = attempt.mem_mb
        if not peak:
            continue
        shape = attempt.world_size // (len(attempt.nodes) or 1) if attempt.world_size else None
        return float(peak) if shape in (None, procs_per_node) else None
    return None


UNITS_MB = {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}


def requested_mb(job: dict[str, str]) -> int | None:
    """The memory a node of a job got (its scontrol record's ``MinMemoryNode``, e.g.
    ``2900M``, ``4G``); None where it asked per CPU or SLURM did not say."""
    value = job.get("MinMemoryNode", "")
    unit = value[-1:].upper()
    if unit not in UNITS_MB or not value[:-1].replace(".", "", 1).isdigit():
        return int(value) if value.isdigit() else None
    return round(float(value[:-1]) * UNITS_MB[unit])
