"""Each training process on CPUs of its own: a CPU rank on its share of the job's cores, a GPU
rank on cores of its GPU's NUMA node.

CPU ranks: local rank ``r`` of ``n`` processes with ``t`` threads each gets the ``r``-th ``t``
of the CPUs the job holds, in CPU order, when the job holds exactly ``n`` x ``t`` of them: a
SLURM allocation, or a local run sharing out the machine. A mask with more CPUs may be shared
with other jobs (two Snakemake jobs side by side see the same mask), so it is left to the
kernel, as is one with fewer. Unbound, the kernel moved the ranks and their gloo threads
between cores: bound, the default 2 x 1 run trained 10 % more images/s (4,184-4,413 against
3,876-3,967 on the 2-core CI machine, 2026-11-25) with the same weights. The threads the
process group starts (gloo's) run on any of the job's CPUs (:func:`threads_free`).

GPU ranks: the job's CPUs on the NUMA node of the rank's GPU (its PCI device's ``numa_node``),
whole cores split evenly among the node's GPUs that the job's ranks train on, as torchrun's
``--numa-binding=exclusive`` does (and as SLURM's ``--gpu-bind=closest`` would with a task per
GPU): the rank's data loading, pinned-memory copies and NCCL threads stay near its GPU. A
rank that would get fewer cores so than an even split of the job's cores gives (its node holds
few or none of them) is left unbound, so that no CPU of the job stays idle.
(Unmeasured: no multi-socket GPU machine was at hand; torch's docs quote 1-10 %.)
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

SYS = Path("/sys")


def share(
    cpus: list[int], local_rank: int, local_world_size: int, threads: int
) -> list[int] | None:
    """The CPUs of ``local_rank``; None unless ``cpus`` holds exactly every rank's threads."""
    if threads < 1 or local_world_size < 1 or len(cpus) != local_world_size * threads:
        return None
    ordered = sorted(cpus)
    return ordered[local_rank * threads : (local_rank + 1) * threads]


@dataclass(frozen=True)
class Topology:
    """Where each CPU sits: its NUMA node and its core (the lowest CPU of its siblings)."""

    node: dict[int, int]
    core: dict[int, int]

    @classmethod
    def read(cls, sys_root: Path = SYS) -> Topology:
        node: dict[int, int] = {}
        for folder in (sys_root / "devices/system/node").glob("node[0-9]*"):
            for cpu in cpu_list((folder / "cpulist").read_text()):
                node[cpu] = int(folder.name[4:])
        core = {}
        for cpu in node:
            siblings = sys_root / f"devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"
            core[cpu] = min(cpu_list(siblings.read_text())) if siblings.exists() else cpu
        if not node:
            raise OSError(f"no NUMA node in {sys_root / 'devices/system/node'}")
        return cls(node, core)


def cpu_list(text: str) -> list[int]:
    """The CPUs of a kernel CPU list such as ``0-3,8,10-11``."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def gpu_share(
    cpus: list[int], topology: Topology, gpu_nodes: dict[int, int], device: int
) -> list[int] | None:
    """The CPUs of the rank training on GPU ``device``: the cores of ``cpus`` on its GPU's
    NUMA node, split evenly, in core order, among the GPUs of ``gpu_nodes`` (device -> NUMA
    node of each GPU the node's ranks train on) on that node. None where that gives it fewer
    cores than an even split of all of ``cpus``' cores among the ranks would (GPUs crowded on
    one NUMA node, the job's CPUs elsewhere): binding would leave CPUs of the job idle."""
    node = gpu_nodes[device]
    cores: dict[int, list[int]] = {}
    for cpu in sorted(cpus):
        if topology.node.get(cpu) == node:
            cores.setdefault(topology.core.get(cpu, cpu), []).append(cpu)
    peers = sorted(d for d, n in gpu_nodes.items() if n == node)
    if len(cores) < len(peers):  # not a core each
        return None
    i, ordered = peers.index(device), sorted(cores)
    mine = ordered[i * len(ordered) // len(peers) : (i + 1) * len(ordered) // len(peers)]
    every_core = {topology.core.get(cpu, cpu) for cpu in cpus}
    if len(mine) < len(every_core) // len(gpu_nodes):
        return None
    return sorted(cpu for core in mine for cpu in cores[core])


def pci_numa_node(domain: int, bus: int, slot: int, sys_root: Path = SYS) -> int:
    """The NUMA node of a PCI device (0 where the machine has one: the kernel says -1)."""
    path = sys_root / f"bus/pci/devices/{domain:04x}:{bus:02x}:{slot:02x}.0/numa_node"
    return max(int(path.read_text()), 0)


def _bind_threads(cpus: list[int], tasks: Iterable[str] | None = None) -> None:
    """Bind ``tasks`` (default: every thread started already; later ones inherit)."""
    for task in os.listdir("/proc/self/task") if tasks is None else tasks:
        with contextlib.suppress(ProcessLookupError, PermissionError):  # a thread that ended
            os.sched_setaffinity(int(task), cpus)


@contextlib.contextmanager
def threads_free(cpus: list[int] | None) -> Iterator[None]:
    """The threads started inside on any of ``cpus`` (the job's; None: left as they start),
    not on the rank's own: the process group's (gloo's I/O loop and work threads), which wake
    for every message. Bound with the rank, each woke on its core and took it from the step:
    the MLP of bench/step_overhead.py at 2 ranks x 1 thread 2.7-2.8 ms a step bound, 1.5-1.8
    ms with them free (2026-12-07, the 2-core AMD EPYC; the CNN's the same within 3 %)."""
    before = set(os.listdir("/proc/self/task"))
    try:
        yield
    finally:
        if cpus is not None:
            _bind_threads(cpus, set(os.listdir("/proc/self/task")) - before)


def bind(local_rank: int, local_world_size: int, threads: int) -> list[int] | None:
    """Bind every thread of this CPU rank to its share of the CPUs; return them, or None."""
    mine = share(list(os.sched_getaffinity(0)), local_rank, local_world_size, threads)
    if mine is None:
        return None
    _bind_threads(mine)
    log.info("local rank %d bound to CPUs %s", local_rank, mine)
    return mine


def bind_gpu_rank(local_rank: int, device: int, devices: list[int]) -> list[int] | None:
    """Bind every thread of this GPU rank (on CUDA ``device``; ``devices``: those the node's
    ranks train on) to cores near its GPU; return them, or None (unbound)."""
    import torch

    try:
        gpu_nodes = {}
        for d in devices:
            p = torch.cuda.get_device_properties(d)
            gpu_nodes[d] = pci_numa_node(p.pci_domain_id, p.pci_bus_id, p.pci_device_id)
        mine = gpu_share(list(os.sched_getaffinity(0)), Topology.read(), gpu_nodes, device)
    except (OSError, ValueError, RuntimeError, AttributeError) as e:  # no topology: leave it
        log.info("local rank %d left unbound: no NUMA topology (%s)", local_rank, e)
        return None
    if mine is None:
        log.info("local rank %d left unbound: NUMA node %d, its GPU's, holds less than its "
                 "share of the job's cores", local_rank, gpu_nodes[device])  # fmt: skip
        return None
    _bind_threads(mine)
    log.info("local rank %d (GPU %d, NUMA node %d) bound to CPUs %s", local_rank, device,
             gpu_nodes[device], mine)  # fmt: skip
    return mine
