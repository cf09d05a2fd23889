"""A quick check that this environment can train: versions, devices, one DDP step."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddppipe.parallel import software
from ddppipe.tasks.model import Net


def run() -> dict[str, Any]:
    """Versions, visible GPUs, and a one-process all-reduce and DDP training step.

    On the first GPU with NCCL when CUDA works here, else on the CPU with gloo.
    """
    report: dict[str, Any] = software.stack()
    cuda = torch.cuda.is_available()
    report["cuda_available"] = cuda
    report["nccl_available"] = dist.is_nccl_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    report["backend"] = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(report["backend"], store=dist.HashStore(), rank=0, world_size=1)
    try:
        value = torch.ones(3, device=device)
        dist.all_reduce(value)
        model = DDP(Net().to(device), device_ids=[0] if cuda else None)
        loss = model(torch.randn(4, 1, 28, 28, device=device)).logsumexp(1).mean()
        loss.backward()
        report["ddp_step"] = bool(torch.isfinite(loss)) and value.tolist() == [1.0, 1.0, 1.0]
    finally:
        dist.destroy_process_group()
    if not report["ddp_step"]:
        raise RuntimeError("selfcheck: the DDP smoke test gave wrong values")
    return report
