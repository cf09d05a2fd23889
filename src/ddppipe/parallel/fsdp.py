"""Sharded data parallel (FSDP2): a model's blocks, then its root, sharded across the ranks.

The blocks are the model's ``shard_blocks`` attribute when it has one (modules, or the names
of its submodules as ``named_modules()`` gives them), else every module of its outermost
``nn.ModuleList``s (a transformer's layers), else its top-level children that hold parameters.
Each block gathers its full parameters for its own forward and backward only, so a rank holds
one block's full weights at a time plus its shards of the rest.

``hsdp`` (hybrid) shards the same blocks within a node and replicates them across the nodes:
a 2-D mesh ``(replicate=nnodes, shard=nproc_per_node)``, which FSDP2 treats as HSDP (the
shards all-gather and reduce-scatter on a node's fast links; only the gradients' all-reduce
crosses nodes). :func:`mesh_shape` decides the mesh. Activation checkpointing
(:func:`checkpoint_activations`) recomputes each block's activations in the backward instead
of keeping them, under any strategy.

Under bf16 mixed precision the BatchNorm layers keep float32 parameters (sharded as groups of
their own): their running statistics are float32, and normalizing bf16 activations with them
takes float32 weights (torchtitan #674); a sharded model has contiguous parameters only, so a
preset's channels_last is left out (:data:`ddppipe.settings.presets.SHARDED`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ddppipe.core.errors import UserError
from ddppipe.settings import presets

STRATEGIES = ("ddp", "fsdp", "hsdp")
SHARDED = presets.SHARDED  # the strategies FSDP2 trains
MESH_DIMS = ("replicate", "shard")  # the dimensions of hsdp's 2-D mesh


class ShardingError(ValueError, UserError):
    """A model that cannot be sharded as configured."""


def blocks(model: nn.Module, why: str = "launch.strategy fsdp") -> list[nn.Module]:
    """The modules FSDP shards one by one (see the module's docstring), outermost first.
    ``why``: the setting that needs them, for the messages."""
    named = getattr(model, "shard_blocks", None)
    if named is not None:
        return _named_blocks(model, named, why)
    found: list[nn.Module] = []
    inside: set[int] = set()
    for _, module in model.named_modules():
        if id(module) in inside:
            continue
        if isinstance(module, nn.ModuleList):
            for block in module:
                found.append(block)
                inside.update(id(m) for m in block.modules())
    found = [m for m in found if _has_parameters(m)]
    if found:
        return found
    found = [child for child in model.children() if _has_parameters(child)]
    if not found:
        raise ShardingError(
            f"{why}: {type(model).__name__} has no blocks (no nn.ModuleList and no child "
            "module with parameters): give the model a shard_blocks attribute (the submodules "
            f"to shard and checkpoint, e.g. its layers), or {_instead(why)}"
        )
    return found


def _instead(why: str) -> str:
    if why.startswith("train.activation_checkpointing"):
        return "set train.activation_checkpointing: false"
    return "use launch.strategy: ddp"


def _named_blocks(model: nn.Module, named: Iterable[nn.Module | str], why: str) -> list[nn.Module]:
    modules = dict(model.named_modules())
    chosen = []
    for item in named:
        if isinstance(item, str):
            if item not in modules:
                raise ShardingError(
                    f"{why}: {type(model).__name__}.shard_blocks names "
                    f"{item!r}, which is not one of its submodules (e.g. "
                    f"{', '.join(list(modules)[1:4])})"
                )
            item = modules[item]
        chosen.append(item)
    if not chosen:
        raise ShardingError(
            f"{why}: {type(model).__name__}.shard_blocks is empty: name the submodules "
            f"to shard, or {_instead(why)}"
        )
    return chosen


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def mesh_shape(strategy: str, nnodes: int, nproc_per_node: int) -> tuple[int, ...]:
    """The device mesh FSDP2 shards over: ``(world,)`` for ``fsdp`` (every rank holds a shard),
    ``(nnodes, nproc_per_node)`` for ``hsdp`` (replicate across nodes, shard within one); on
    one node ``hsdp`` is plain ``fsdp``."""
    if strategy not in SHARDED:
        raise ShardingError(
            f"launch.strategy {strategy!r} shards nothing: a mesh is for "
            f"{' or '.join(SHARDED)} (hsdp: shard within a node, replicate across nodes)"
        )
    if nnodes < 1 or nproc_per_node < 1:
        raise ShardingError(
            f"launch.strategy {strategy}: {nnodes} node(s) of {nproc_per_node} process(es): "
            "both must be at least 1"
        )
    if strategy == "hsdp" and nnodes > 1:
        return (nnodes, nproc_per_node)
    return (nnodes * nproc_per_node,)


def mesh(device: torch.device, shape: tuple[int, ...]) -> Any:
    """The device mesh of ``shape`` (:func:`mesh_shape`) over the default process group's
    ranks, of ``device``'s type; raise ShardingError if the ranks are not that many."""
    from torch.distributed.device_mesh import init_device_mesh

    world = torch.distributed.get_world_size()
    if math.prod(shape) != world:
        raise ShardingError(
            f"a mesh of {' x '.join(map(str, shape))} ranks for a world of {world}: "
            "launch.nnodes x launch.nproc_per_node must be the world size"
        )
    # An explicit mesh of the ranks' device type: gloo with CUDA visible crashed without one
    # (pytorch #132471).
    if len(shape) == 1:
        return init_device_mesh(device.type, shape)
    return init_device_mesh(device.type, shape, mesh_dim_names=MESH_DIMS)


def shard(
    model: nn.Module, device: torch.device, bf16: bool, shape: tuple[int, ...] | None = None,
    why: str = "launch.strategy fsdp",
) -> nn.Module:  # fmt: skip
    """Shard ``model`` in place over the mesh of ``shape`` (:func:`mesh_shape`; None: every
    rank of the default process group, 1-D): each block, then the root. ``bf16``: compute in
    bfloat16 and reduce gradients in float32. ``why``: the setting, for the messages."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    ranks = mesh(device, shape or (torch.distributed.get_world_size(),))
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32
    )
    if bf16:  # float32 weights beside float32 running statistics; bf16 in and out
        full = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                    cast_forward_inputs=False)  # fmt: skip
        for norm in batch_norms(model):
            fully_shard(norm, mesh=ranks, mp_policy=full)
    for block in blocks(model, why):
        if not isinstance(block, FSDPModule):  # (a BatchNorm block: sharded above)
            fully_shard(block, mesh=ranks, mp_policy=policy)
    fully_shard(model, mesh=ranks, mp_policy=policy)
    return model


def batch_norms(model: nn.Module) -> list[nn.Module]:
    """The BatchNorm layers of ``model`` that keep running statistics."""
    norm = nn.modules.batchnorm._BatchNorm
    return [m for m in model.modules() if isinstance(m, norm) and m.track_running_stats]


@contextlib.contextmanager
def _statistics_counted_once(block: nn.Module) -> Iterator[None]:
    """(Around the recomputed forward of a checkpointed block) its BatchNorm layers' running
    statistics as they were before: the forward counted the batch into them already."""
    kept = [(norm, [b.clone() for b in _statistics(norm)]) for norm in batch_norms(block)]
    try:
        yield
    finally:
        with torch.no_grad():
            for norm, before in kept:
                for buffer, value in zip(_statistics(norm), before, strict=True):
                    buffer.copy_(value)


def _statistics(norm: nn.Module) -> list[torch.Tensor]:
    return [norm.running_mean, norm.running_var, norm.num_batches_tracked]


def checkpoint_activations(model: nn.Module) -> nn.Module:
    """Recompute each block's activations (:func:`blocks`) in the backward instead of keeping
    them (non-reentrant ``torch.utils.checkpoint``, applied in place by the composable
    ``checkpoint``: parameter names and state dicts stay as they were; a BatchNorm layer counts
    each batch once). Before sharding or DDP.
    """
    from torch.distributed._composable import checkpoint

    for block in blocks(model, why="train.activation_checkpointing"):
        checkpoint(block, context_fn=lambda b=block: (contextlib.nullcontext(),
                                                      _statistics_counted_once(b)))  # fmt: skip
    return model


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` was sharded by :func:`shard`."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)
