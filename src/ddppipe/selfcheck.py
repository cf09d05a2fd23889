"""A quick check that this environment can train: versions, devices, one DDP step."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddppipe import provenance
from ddppipe.model import Net


def run() -> dict[str, Any]:
    """Versions, visible GPUs, and a one-process gloo all-reduce and DDP training step."""
    report: dict[str, Any] = provenance.software()
    report["cuda_available"] = torch.cuda.is_available()
    report["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    report["nccl_available"] = dist.is_nccl_available()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        value = torch.ones(3)
        dist.all_reduce(value)
        model = DDP(Net())
        loss = model(torch.randn(4, 1, 28, 28)).logsumexp(1).mean()
        loss.backward()
        report["ddp_step"] = bool(torch.isfinite(loss)) and value.tolist() == [1.0, 1.0, 1.0]
    finally:
        dist.destroy_process_group()
    if not report["ddp_step"]:
        raise RuntimeError("selfcheck: the DDP smoke test gave wrong values")
    return report
