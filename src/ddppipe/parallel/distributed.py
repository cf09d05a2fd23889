"""Process-group set-up: backend and device from the hardware, ranks from the launcher."""

from __future__ import annotations

import datetime
import logging
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ddppipe.core import process_times, system
from ddppipe.parallel import cpu_binding, devices, environments

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Context:
    """This process's place in the run."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str
    launcher: str
    local_world_size: int  # processes on this node

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def choose_backend(cuda: bool) -> str:
    """NCCL on GPUs, gloo on CPUs."""
    return "nccl" if cuda else "gloo"


def setup(use: devices.Use, timeout_s: float = 600) -> Context:
    """Detect the launcher, pick device and backend, and join the process group.

    ``use``: the run spec's device (:mod:`ddppipe.settings.run_spec`). With ``gpu`` a rank
    that cannot use a GPU fails here, naming its node and what it sees, instead of training
    on the CPU.
    """
    env = environments.detect(os.environ)
    if use == "gpu" and env.local_world_size is None:
        raise environments.LauncherEnvError(
            f"{env.name}: the launcher of rank {env.rank} does not say how many processes its "
            "node runs, and a GPU rank needs that to take a GPU and CPUs of its own: set it "
            "where the launcher puts it (pmi: MPI_LOCALNRANKS or PMI_LOCAL_SIZE; openmpi: "
            "OMPI_COMM_WORLD_LOCAL_SIZE; slurm: SLURM_STEP_TASKS_PER_NODE with "
            "SLURM_STEP_NODELIST; torchrun: LOCAL_WORLD_SIZE), or launch with torchrun or srun"
        )
    device = devices.select(env.local_rank, env.local_world_size, use)
    cuda = device.type == "cuda"
    local = env.local_world_size or 1
    free: list[int] | None = None  # (a bound CPU rank: the job's CPUs, its group's threads')
    if cuda:  # binding before the process group starts its threads
        torch.cuda.set_device(device)
        in_use = devices.node_devices(device.index, torch.cuda.device_count(), local)
        cpu_binding.bind_gpu_rank(env.local_rank, device.index, in_use)
    else:
        job = sorted(os.sched_getaffinity(0))
        free = job if cpu_binding.bind(env.local_rank, local, torch.get_num_threads()) else None
    chosen = choose_backend(cuda)
    with cpu_binding.threads_free(free):
        _join(env, chosen, timeout_s)
    if cuda and env.world_size > 1:
        check_distinct_gpus(device)
    log.info("%s, backend %s, device %s", env.describe(), chosen, device)
    process_times.mark("process_group")  # (a start-up mark: ddppipe.runstate.startup)
    return Context(env.rank, env.local_rank, env.world_size, device, chosen, env.name, local)


def _join(env: environments.ProcessEnvironment, chosen: str, timeout_s: float) -> None:
    """Join the launcher's process group, backend ``chosen``."""
    timeout = datetime.timedelta(seconds=timeout_s)
    system.raise_open_files_limit()  # rank 0's sockets to every rank (gloo's gathers)
    if env.name == "single":
        dist.init_process_group(
            chosen, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
    elif env.name == "torchrun":  # join the agent's store, which torchrun already serves
        dist.init_process_group(chosen, init_method="env://", timeout=timeout)
    else:
        dist.init_process_group(
            chosen,
            init_method=f"tcp://{env.master_addr}:{env.master_port}",
            rank=env.rank,
            world_size=env.world_size,
            timeout=timeout,
        )


def check_distinct_gpus(device: torch.device) -> None:
    """Collective: raise DeviceError on every rank when two ranks of a node share a GPU.

    (Two ranks that see one device each may still see the same one, e.g. a node with fewer
    GPUs than processes; NCCL would abort at its first collective with "Duplicate GPU
    detected".) The check goes through a gloo group, before NCCL starts a communicator: every
    rank's GPU to rank 0, which sends every rank its verdict (:func:`shared_gpu`).
    """
    mine = (socket.gethostname(), str(torch.cuda.get_device_properties(device).uuid))
    main = dist.get_rank() == 0
    seen: list[tuple[str, str]] | None = [("", "")] * dist.get_world_size() if main else None
    verdict: list[str | None] = [None]
    group = dist.new_group(backend="gloo")
    try:
        dist.gather_object(mine, seen, dst=0, group=group)
        if seen is not None:
            verdict[0] = shared_gpu(seen)
        dist.broadcast_object_list(verdict, src=0, group=group)
    finally:
        dist.destroy_process_group(group)
    if verdict[0] is not None:
        raise devices.DeviceError(verdict[0])


def shared_gpu(seen: list[tuple[str, str]]) -> str | None:
    """What is wrong when two ranks share a GPU, from each rank's (host, GPU UUID); None when
    every rank has its own."""
    by_gpu: dict[tuple[str, str], list[int]] = {}
    for rank, key in enumerate(seen):
        by_gpu.setdefault(key, []).append(rank)
    shared = {key: ranks for key, ranks in by_gpu.items() if len(ranks) > 1}
    if not shared:
        return None
    (host, uuid), ranks = next(iter(shared.items()))
    return (
        f"{host}: ranks {ranks} share one GPU ({uuid}); each process needs its own: "
        "set launch.nproc_per_node to the node's GPUs"
    )


def collective_device() -> torch.device:
    """Where a tensor for a collective of the default group must be: NCCL's GPU, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def teardown(synchronize: bool = True) -> None:
    """Leave the process group; with ``synchronize``, after every rank got here.

    A rank that left while another still received its last broadcast made gloo abort
    ("terminate called without an active exception").
    """
    if dist.is_initialized():
        if synchronize:
            dist.barrier()
        dist.destroy_process_group()
