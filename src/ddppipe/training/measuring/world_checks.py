"""The checks of the training's world once its ranks joined it, before step 1.

Collective, on every rank of the world with the training's backend on the training's device:
an all-reduce whose sum is checked, the hosts of the ranks, the all-reduce's bus bandwidth for
the whole world and for each pair of nodes, and every node's GEMM peak in the training's
precision (all its processes multiplying at once: :func:`ddppipe.training.measuring.peak.
gemm_gflops`). A SLURM slot of its own runs them in the training's ranks (its slot record's
``checks``: :func:`wanted`); ``ddppipe preflight`` runs the same in a world of its own, a check
before a long queue (:mod:`ddppipe.launching.preflight`). The nodes' own checks, before they
join, are :mod:`ddppipe.parallel.node_check`'s.
"""

from __future__ import annotations

import itertools
import logging
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ddppipe.core import process_times, slot
from ddppipe.core.errors import UserError
from ddppipe.parallel import devices
from ddppipe.training.measuring import efficiency, peak

if TYPE_CHECKING:
    from ddppipe.parallel.distributed import Context

log = logging.getLogger(__name__)

BANDWIDTH_BYTES = 16 * 2**20  # per all-reduce of the bandwidth test
BANDWIDTH_ITERATIONS = 5


class WorldCheckError(RuntimeError, UserError):
    """An all-reduce of the world gave a wrong sum; the message says which rank saw what."""


@dataclass(frozen=True)
class Report:
    """A rank's outcome of the checks: its line (rank 0's with the figures), and (rank 0) the
    nodes' GEMM peaks, ``{"precision": ..., "gflops": {node: GFLOP/s}}``."""

    line: str
    peak: dict[str, Any] | None


def wanted() -> bool:
    """Whether this process's slot asks its ranks for the checks (a SLURM job of its own)."""
    found = slot.read()
    return found is not None and found.checks


def bus_bandwidth(nbytes: int, ranks: int, seconds: float) -> float:
    """All-reduce bus bandwidth, bytes/s (NCCL tests' definition: 2(n-1)/n of the size per s)."""
    return nbytes * 2 * (ranks - 1) / ranks / seconds if ranks > 1 else 0.0


def in_slot(ctx: Context, precision: str, meter: efficiency.SlotMeter) -> dict[str, Any] | None:
    """Collective (the ranks of a checked slot, before step 1): :func:`run`, timed in the
    slot's figures (``checks``) and marked; rank 0 logs its line. Rank 0's peaks (others: None)."""
    with meter.phase("checks"):
        report = run(ctx, precision)
    process_times.mark("checks")  # (the slot's start-up part: ddppipe.runstate.startup)
    if ctx.is_main:
        log.info("checks: %s", report.line)
    return report.peak


def run(ctx: Context, precision: str) -> Report:
    """Collective: the checks on this rank (``ctx``: its place in the world it joined);
    ``precision``: the one the ranks decided to train in (fp32 or bf16)."""
    import torch
    import torch.distributed as dist

    rank, world, device = ctx.rank, ctx.world_size, ctx.device

    value = torch.tensor([rank + 1.0], device=device)
    dist.all_reduce(value)
    expected = world * (world + 1) / 2
    if value.item() != expected:
        raise WorldCheckError(
            f"{socket.gethostname()} rank {rank}: all-reduce gave {value.item()}, expected "
            f"{expected}: the interconnect or its library corrupts data"
        )
    hosts: list[str] = [""] * world
    dist.all_gather_object(hosts, socket.gethostname())
    tensor = torch.ones(BANDWIDTH_BYTES // 4, device=device)
    overall = _figure(f"world ({world} ranks)", world, _timed_allreduce(tensor))
    pairs: list[str] = []  # measured by the pair's first rank
    for a, b in itertools.combinations(list(dict.fromkeys(hosts)), 2):
        ranks = [r for r, h in enumerate(hosts) if h in (a, b)]
        group = dist.new_group(ranks)  # collective: every rank creates every group
        if rank in ranks:
            seconds = _timed_allreduce(tensor, group)
            if rank == ranks[0]:
                pairs.append(_figure(f"{a}<->{b}", len(ranks), seconds))
            dist.destroy_process_group(group)  # (not kept through the training)
    gathered: list[list[str]] = [[] for _ in range(world)]
    dist.all_gather_object(gathered, pairs)
    nodes_peak = _gemm_peaks(device, precision, world)
    line = f"{socket.gethostname()} rank {rank}/{world}: all-reduce ok ({ctx.backend} on {device})"
    if rank != 0:
        return Report(line, None)
    line += "; bus bandwidth " + "; ".join([overall, *itertools.chain(*gathered)])
    line += f"; GEMM peak ({precision}): " + "; ".join(
        f"{host} {gflops:,.0f} GFLOP/s" for host, gflops in nodes_peak.items()
    )
    return Report(line, {"precision": precision, "gflops": nodes_peak})


def _timed_allreduce(tensor: Any, group: Any = None) -> float:
    """Seconds per all-reduce of ``tensor`` within ``group`` (after one warm-up)."""
    import torch.distributed as dist

    dist.all_reduce(tensor, group=group)
    devices.synchronize(tensor.device)
    dist.barrier(group=group)
    started = time.perf_counter()
    for _ in range(BANDWIDTH_ITERATIONS):
        dist.all_reduce(tensor, group=group)
    devices.synchronize(tensor.device)
    return (time.perf_counter() - started) / BANDWIDTH_ITERATIONS


def _gemm_peaks(device: Any, precision: str, world: int) -> dict[str, float]:
    """Collective: GFLOP/s per node, every process multiplying matrices at the same time."""
    import torch.distributed as dist

    dist.barrier()
    mine = (socket.gethostname(), peak.gemm_gflops(device, precision))
    measured: list[Any] = [None] * world
    dist.all_gather_object(measured, mine)
    return efficiency.node_sums(measured)


def _figure(what: str, ranks: int, seconds: float) -> str:
    size = BANDWIDTH_BYTES / 2**20
    if ranks < 2:
        return f"{what}: no peer ({seconds * 1e3:.2f} ms per {size:.0f} MiB all-reduce)"
    return f"{what}: {bus_bandwidth(BANDWIDTH_BYTES, ranks, seconds) / 1e9:.2f} GB/s"
