"""The model as the ranks train it, per ``launch.strategy``: DDP, FSDP2 (``fsdp``) or hybrid
FSDP2 (``hsdp``), its blocks' activations checkpointed first when
``train.activation_checkpointing`` asks. The one place that wraps a model: the training loop
and a script's ``job.shard()`` both call :func:`wrap`.
"""

from __future__ import annotations

import inspect
import logging

import torch
from torch import nn

from ddppipe.parallel import fsdp

log = logging.getLogger(__name__)


# A norm layer's running statistics (BatchNorm's): updated by a training forward, read only in
# evaluation.
RUNNING = ("running_mean", "running_var", "num_batches_tracked")


def running_statistics_only(model: nn.Module) -> bool:
    """Whether every buffer of ``model`` is a norm layer's running statistics (BatchNorm's
    mean, variance and count: updated by a training forward, read only in evaluation)."""
    for module in model.modules():
        for name, _ in module.named_buffers(recurse=False):
            if not (isinstance(module, nn.modules.batchnorm._NormBase) and name in RUNNING):
                return False
    return True


def wrap(
    model: nn.Module, device: torch.device, strategy: str, nnodes: int, nproc_per_node: int,
    bf16: bool = False, activation_checkpointing: bool = False, broadcast_buffers: bool = True,
) -> nn.Module:  # fmt: skip
    """What trains ``model`` (already on ``device``) in this process group: the model itself,
    sharded in place (``fsdp``, ``hsdp``), or its ``DistributedDataParallel`` wrapper (``ddp``).

    ``bf16``: the recipe trains in bfloat16 (FSDP: bf16 compute, fp32 gradient reduction; DDP:
    bf16 gradient all-reduce). ``nnodes`` and ``nproc_per_node`` shape hsdp's mesh.
    ``broadcast_buffers``: DDP sends rank 0's buffers to the others before every forward (off:
    the caller synchronises them where they are read).
    """
    if strategy not in fsdp.STRATEGIES:
        raise fsdp.ShardingError(
            f"launch.strategy {strategy!r} is not one of {', '.join(fsdp.STRATEGIES)}"
        )
    if activation_checkpointing:
        fsdp.checkpoint_activations(model)
    world = torch.distributed.get_world_size()
    if strategy in fsdp.SHARDED:
        shape = fsdp.mesh_shape(strategy, nnodes, nproc_per_node)
        if torch.distributed.get_rank() == 0 and strategy == "hsdp":
            if len(shape) == 1:
                log.info("launch.strategy hsdp on one node: plain fsdp over its %d ranks", world)
            elif nproc_per_node == 1:
                log.warning(
                    "launch.strategy hsdp with one process per node shards nothing (a mesh of "
                    "%d x 1): use fsdp to shard across the nodes", nnodes,
                )  # fmt: skip
        return fsdp.shard(model, device, bf16, shape, why=f"launch.strategy {strategy}")
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    # Gradients live in DDP's all-reduce buckets: no copy in or out of them per step.
    # (torch 2.14 renamed the setting: forward_sync_buffers; the old name warns there)
    renamed = "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
    sync = {"forward_sync_buffers" if renamed else "broadcast_buffers": broadcast_buffers}
    net = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
              gradient_as_bucket_view=True, **sync)  # fmt: skip
    if bf16 and world > 1:
        # bf16 training all-reduces bf16 gradients: half the bytes of every step's all-reduce
        # (DDP's compression hook; gloo and NCCL reduce bf16).
        net.register_comm_hook(None, default_hooks.bf16_compress_hook)
    return net
