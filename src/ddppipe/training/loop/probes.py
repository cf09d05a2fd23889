"""What a slot measures besides its steps: the all-reduce time a step exposes, and its FLOPs.

Both run the model outside training and leave it as they found it (weights, gradients, buffers,
the random stream), so a measured run trains exactly as an unmeasured one.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddppipe.data import batches
from ddppipe.parallel import devices
from ddppipe.training.loop import evaluate
from ddppipe.training.measuring import efficiency

COMM_PROBES = 3  # per slot: steps timed with and without the all-reduce (the fastest counts)


def communication(
    ddp: DDP, optimizer: torch.optim.Optimizer, forward_backward: Callable[[], Any],
    device: torch.device,
) -> tuple[float, float]:  # fmt: skip
    """Collective: the all-reduce seconds a step does not hide behind its backward, and the
    probe's own seconds.

    ``forward_backward`` (one batch's) runs :data:`COMM_PROBES` times with DDP's all-reduce
    and as often without (``no_sync``); the gradients are dropped and the RNG and buffers
    restored, so training is unchanged.
    """
    started = time.perf_counter()
    buffers = [b.detach().clone() for b in ddp.module.buffers()]
    cuda = [device] if device.type == "cuda" else []
    timings: dict[bool, list[float]] = {True: [], False: []}
    with torch.random.fork_rng(devices=cuda):
        for synced in [False, True] * COMM_PROBES:
            devices.synchronize(device)
            at = time.perf_counter()
            with contextlib.nullcontext() if synced else ddp.no_sync():
                forward_backward()
            devices.synchronize(device)
            timings[synced].append(time.perf_counter() - at)
            optimizer.zero_grad(set_to_none=True)
    for buffer, saved in zip(ddp.module.buffers(), buffers, strict=True):
        buffer.copy_(saved)
    return min(timings[True]) - min(timings[False]), time.perf_counter() - started


def flops_per_image(
    model: nn.Module, dataset: Any, device: torch.device, loss_fn: evaluate.LossFn,
    dtype: torch.dtype, memory_format: torch.memory_format,
) -> float | None:  # fmt: skip
    """FLOPs of one training image: forward and backward of two, on a copy of the model
    (no all-reduce, no gradient in DDP's buckets; the Trainer's resume reseeds the RNG)."""
    batch = batches.samples(dataset, 2, device)
    replica = copy.deepcopy(model)

    def step() -> None:
        evaluate.loss_of(replica, batch, loss_fn, dtype, memory_format).backward()

    return efficiency.count_flops_per_image(step, int(batch[1].shape[0]))
