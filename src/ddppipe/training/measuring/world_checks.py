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
    hosts = _gathered(socket.gethostname(), world)  # every rank's, on rank 0
    tensor = torch.ones(BANDWIDTH_BYTES // 4, device=device)
    overall = _figure(f"world ({world} ranks)", world, _timed_allreduce(tensor))
    nodes = list(dict.fromkeys(hosts or []))
    # This rank's pair a round, from rank 0 (no rank needs every rank's host)
    planned: list[Any] = [None]
    dist.scatter_object_list(planned, pair_plans(hosts) if hosts else None, src=0)
    pairs: list[tuple[int, int, float]] = []  # (node, node, bus bandwidth) by the pair's first rank
    for mine, ranks in planned[0]:
        # Only a pair's ranks make its group, so the round's pairs run at once. Every rank
        # makes one group a round (its pair's, else one of itself): torch names a group made
        # so from its ranks and how many groups each of them made before, which must agree.
        group = dist.new_group(ranks or [rank], use_local_synchronization=True)
        if mine is not None:
            seconds = _timed_allreduce(tensor, group)
            if rank == ranks[0]:
                pairs.append((*mine, bus_bandwidth(BANDWIDTH_BYTES, len(ranks), seconds)))
        dist.destroy_process_group(group)  # (not kept through the training)
    gathered = _gathered(pairs, world)
    nodes_peak = _gemm_peaks(device, precision, world)
    line = f"{socket.gethostname()} rank {rank}/{world}: all-reduce ok ({ctx.backend} on {device})"
    if rank != 0:
        return Report(line, None)
    measured = sorted(itertools.chain(*gathered or []))
    line += "; bus bandwidth " + "; ".join(
        [overall, *(f"{nodes[i]}<->{nodes[j]}: {gbs / 1e9:.2f} GB/s" for i, j, gbs in measured)]
    )
    if slow := slow_pairs({f"{nodes[i]}<->{nodes[j]}": gbs for i, j, gbs in measured}):
        line += "; slow: " + ", ".join(slow)
        log.warning("checks: node pairs far below the median bus bandwidth: %s", ", ".join(slow))
    line += f"; GEMM peak ({precision}): " + "; ".join(
        f"{host} {gflops:,.0f} GFLOP/s" for host, gflops in nodes_peak.items()
    )
    return Report(line, {"precision": precision, "gflops": nodes_peak})


Plan = list[tuple[tuple[int, int] | None, list[int]]]  # a rank's (pair, its ranks) a round


def pair_plans(hosts: list[str]) -> list[Plan]:
    """Each rank's plan from every rank's host (the nodes in order of their first rank): a
    round's pair of nodes it is in (:func:`ring_rounds`) and that pair's ranks, else
    ``(None, [])``; a plan of as many rounds on every rank."""
    nodes: dict[str, list[int]] = {}  # each node's ranks
    for rank, host in enumerate(hosts):
        nodes.setdefault(host, []).append(rank)
    ranks = list(nodes.values())
    rounds: list[dict[int, tuple[int, int]]] = [  # each round's pair of each node in one
        {node: (i, j) for i, j in pairs for node in (i, j)} for pairs in ring_rounds(len(ranks))
    ]
    index = {host: i for i, host in enumerate(nodes)}
    plans: list[Plan] = []
    for host in hosts:
        plan: Plan = []
        for pair_of in rounds:
            mine = pair_of.get(index[host])
            plan.append((mine, sorted(ranks[mine[0]] + ranks[mine[1]]) if mine else []))
        plans.append(plan)
    return plans


def ring_rounds(nodes: int) -> list[list[tuple[int, int]]]:
    """The node pairs the checks time, as rounds whose pairs run at once (no node in two of a
    round): each node with its neighbours on a ring, so a slow link or node shows in two
    pairs; ``nodes`` pairs in at most 3 rounds (1 for 2 nodes), not every pair one by one."""
    if nodes < 2:
        return []
    ring = {tuple(sorted((i, (i + 1) % nodes))) for i in range(nodes)}
    rounds = [[(i, j) for i, j in sorted(ring) if j == i + 1 and i % 2 == parity]
              for parity in (0, 1)]  # fmt: skip
    wrap = [(i, j) for i, j in sorted(ring) if j != i + 1]  # (0, n-1)
    if wrap and nodes % 2 == 0:
        rounds[1].append(wrap.pop())  # (an even ring's wrap pair meets neither's round-1 pair)
    return [r for r in [*rounds, wrap] if r]


SLOW_SHARE = 0.5  # a pair below this share of the median bus bandwidth is named slow


def slow_pairs(bandwidths: dict[str, float]) -> list[str]:
    """The pairs whose bus bandwidth is below :data:`SLOW_SHARE` of the pairs' median, with
    their share of it (3 pairs at least: fewer have no median to speak of)."""
    if len(bandwidths) < 3:
        return []
    ordered = sorted(bandwidths.values())
    median = ordered[len(ordered) // 2]
    return [f"{pair} at {gbs / median:.0%} of the median" for pair, gbs in bandwidths.items()
            if median > 0 and gbs < SLOW_SHARE * median]  # fmt: skip


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
    """Collective: GFLOP/s per node (on rank 0; elsewhere none), every process multiplying
    matrices at the same time."""
    import torch.distributed as dist

    dist.barrier()
    measured = _gathered((socket.gethostname(), peak.gemm_gflops(device, precision)), world)
    return efficiency.node_sums(measured or [])


def _gathered(mine: Any, world: int) -> list[Any] | None:
    """Collective: every rank's ``mine`` on rank 0 (elsewhere None)."""
    import torch.distributed as dist

    found: list[Any] | None = [None] * world if dist.get_rank() == 0 else None
    dist.gather_object(mine, found, dst=0)
    return found


def _figure(what: str, ranks: int, seconds: float) -> str:
    size = BANDWIDTH_BYTES / 2**20
    if ranks < 2:
        return f"{what}: no peer ({seconds * 1e3:.2f} ms per {size:.0f} MiB all-reduce)"
    return f"{what}: {bus_bandwidth(BANDWIDTH_BYTES, ranks, seconds) / 1e9:.2f} GB/s"
