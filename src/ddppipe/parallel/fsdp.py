"""Sharded data parallel (FSDP2): a model's blocks, then its root, sharded across the ranks.

The blocks are the model's ``shard_blocks`` attribute when it has one (modules, or the names
of its submodules as ``named_modules()`` gives them), else every module of its outermost
``nn.ModuleList``s (a transformer's layers), else its top-level children that hold parameters.
Each block gathers its full parameters for its own forward and backward only, so a rank holds
one block's full weights at a time plus its shards of the rest.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ddppipe.core.errors import UserError

STRATEGIES = ("ddp", "fsdp")


class ShardingError(ValueError, UserError):
    """A model that cannot be sharded as configured."""


def blocks(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP shards one by one (see the module's docstring), outermost first."""
    named = getattr(model, "shard_blocks", None)
    if named is not None:
        return _named_blocks(model, named)
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
            f"launch.strategy fsdp: {type(model).__name__} has no blocks to shard (no "
            "nn.ModuleList and no child module with parameters): give the model a "
            "shard_blocks attribute (the submodules to shard, e.g. its layers), or use "
            "launch.strategy: ddp"
        )
    return found


def _named_blocks(model: nn.Module, named: Iterable[nn.Module | str]) -> list[nn.Module]:
    modules = dict(model.named_modules())
    chosen = []
    for item in named:
        if isinstance(item, str):
            if item not in modules:
                raise ShardingError(
                    f"launch.strategy fsdp: {type(model).__name__}.shard_blocks names "
                    f"{item!r}, which is not one of its submodules (e.g. "
                    f"{', '.join(list(modules)[1:4])})"
                )
            item = modules[item]
        chosen.append(item)
    if not chosen:
        raise ShardingError(
            f"launch.strategy fsdp: {type(model).__name__}.shard_blocks is empty: name the "
            "submodules to shard, or use launch.strategy: ddp"
        )
    return chosen


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def shard(model: nn.Module, device: torch.device, bf16: bool) -> nn.Module:
    """Shard ``model`` in place across every rank of the default process group: each block,
    then the root. ``bf16``: compute in bfloat16 and reduce gradients in float32."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # An explicit mesh of the ranks' device type: gloo with CUDA visible crashed without one
    # (pytorch #132471).
    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32
    )
    for block in blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` was sharded by :func:`shard`."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)
