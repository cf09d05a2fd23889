"""Process-group set-up: backend and device from the hardware, ranks from the launcher."""

from __future__ import annotations

import datetime
import logging
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ddppipe import environments

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

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def choose_backend(requested: str, cuda: bool) -> str:
    """NCCL with CUDA, gloo without; an explicit request must fit the hardware."""
    if requested == "auto":
        return "nccl" if cuda else "gloo"
    if requested == "nccl" and not cuda:
        raise RuntimeError("launch.backend is nccl but no CUDA GPU is visible; use auto or gloo")
    return requested


def setup(backend: str = "auto", timeout_s: float = 600) -> Context:
    """Detect the launcher, pick device and backend, and join the process group."""
    env = environments.detect(os.environ)
    cuda = torch.cuda.is_available()
    if cuda:
        if env.local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"local rank {env.local_rank} on {socket.gethostname()} has no GPU: only "
                f"{torch.cuda.device_count()} visible; processes per node must not exceed GPUs "
                "per node"
            )
        device = torch.device("cuda", env.local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    chosen = choose_backend(backend, cuda)
    timeout = datetime.timedelta(seconds=timeout_s)
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
    log.info("%s, backend %s, device %s", env.describe(), chosen, device)
    return Context(env.rank, env.local_rank, env.world_size, device, chosen, env.name)


def teardown(synchronize: bool = True) -> None:
    """Leave the process group; with ``synchronize``, after every rank got here.

    A rank that left while another still received its last broadcast made gloo abort
    ("terminate called without an active exception").
    """
    if dist.is_initialized():
        if synchronize:
            dist.barrier()
        dist.destroy_process_group()
