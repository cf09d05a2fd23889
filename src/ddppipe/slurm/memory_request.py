"""The memory a training job asks for a node when ``slurm.mem_mb`` is null (``--mem``).

Before a run's first slot it is estimated from what its processes hold; once a slot of the run
measured its peak (the fullest node's, as the job's cgroup counts it: its attempt record,
:mod:`ddppipe.training.measuring.efficiency`), later submissions ask for that peak instead
(after a slot the OOM killer killed at its request: for more than that request).
Both with the same margin (:data:`HEADROOM`): a cluster that enforces the request
(``ConstrainRAMSpace``) kills a job whose node goes above it. Either is capped at what the
partition's nodes have (:func:`node_request_mb`): sbatch refuses a request no node can hold.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any

from ddppipe.core.errors import UserError

log = logging.getLogger(__name__)

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
# What a GPU process pins on the host for each parameter of its model, in bytes: its
# checkpoints' kept copy (ddppipe.training.checkpoints.background_copy) of the parameters (fp32)
# and of the optimizer's state: AdamW's and Adadelta's two fp32 buffers a parameter, SGD's
# momentum one. A DDP rank holds all of it; an FSDP rank its shard.
PINNED_BYTES = {"adamw": 4 + 8, "adadelta": 4 + 8, "sgd": 4 + 4}
MIB = 1024 * 1024  # SLURM's M
MIN_GPU_PROCESS_MB = 4000  # the least a GPU process needs: a request below it is refused
HEADROOM = 1.25  # the margin over an estimate or a measured peak
NEAR_LIMIT = 0.90  # a peak at or above this share of its request is flagged (reports.waste)
STEP_MB = 100


def _rounded(mb: float) -> int:
    """``mb`` rounded up to :data:`STEP_MB`."""
    return int(math.ceil(mb / STEP_MB) * STEP_MB)


def estimated_mb(procs_per_node: int, gpus: bool, pinned_mb: int = 0) -> int:
    """A node's request before any slot measured: :data:`GPU_PROCESS_MB` a GPU process and the
    ``pinned_mb`` its checkpoints pin (:func:`pinned_mb`; 0: not known), else the libraries once
    and :data:`CPU_PROCESS_MB` a process, with the margin."""
    if gpus:
        return _rounded(procs_per_node * (GPU_PROCESS_MB + pinned_mb))
    return _rounded((SHARED_MB + procs_per_node * CPU_PROCESS_MB) * HEADROOM)


def pinned_mb(parameters: int, optimizer: str, shards: int = 1) -> int:
    """MB (MiB) a GPU process pins on the host for its checkpoints: ``parameters`` (its model's)
    and ``optimizer``'s state (:data:`PINNED_BYTES`), its share of ``shards`` (FSDP's)."""
    return math.ceil(parameters * PINNED_BYTES[optimizer] / shards / MIB)


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


class MemoryRequestError(ValueError, UserError):
    """``slurm.mem_mb`` asks for more than the partition's nodes have."""


def node_request_mb(mb: int, explicit: bool, node_mb: int | None, per_node: int = 1,
                    least_mb: int = 0) -> int:  # fmt: skip
    """A node's ``--mem`` for ``per_node`` slots (a job: 1; a packed allocation:
    ``sweep.pack.trials_per_node``) of ``mb`` each, fitted to ``node_mb``, what the
    partition's nodes have (:mod:`ddppipe.slurm.sinfo`; None: unknown, asked as is). Above
    it, ddppipe's own figure (an estimate, a measured peak) is capped at it, each slot getting
    its share, and said; ``slurm.mem_mb`` (``explicit``) is refused, as is a node with less
    than the ``least_mb`` a slot's GPU processes need."""
    wanted = mb * per_node
    if node_mb is None or wanted <= node_mb:
        return wanted
    if explicit:
        slots = f"{per_node} trials a node (sweep.pack.trials_per_node) of " if per_node > 1 else ""
        fewer = (f", or sweep.pack.trials_per_node to {max(1, node_mb // mb)}"
                 if per_node > 1 else "")  # fmt: skip
        raise MemoryRequestError(
            f"{slots}slurm.mem_mb {mb:,} MB ask for {wanted:,} MB a node, but the partition's "
            f"nodes have {node_mb:,} MB (sinfo): sbatch would refuse it. Set slurm.mem_mb to "
            f"{node_mb // per_node} or less{fewer}, or to null (sized to fit), or choose a "
            "partition with larger nodes (slurm.partition)"
        )
    if node_mb < least_mb * per_node:
        raise MemoryRequestError(
            f"the partition's nodes have {node_mb:,} MB (sinfo), less than {per_node} slot(s) "
            f"of GPU processes need at least ({least_mb * per_node:,} MB): choose a partition "
            "with larger nodes (slurm.partition), or fewer processes or trials a node"
        )
    share = f", {node_mb // per_node:,} MB a trial" if per_node > 1 else ""
    log.warning("memory request capped at the %s MB the partition's nodes have (sinfo)%s: "
                "ddppipe sized it %s MB", f"{node_mb:,}", share, f"{wanted:,}")  # fmt: skip
    return node_mb
