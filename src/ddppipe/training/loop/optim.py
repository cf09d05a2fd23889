"""The recipe's optimizer and learning-rate schedule (``train.optimizer``, ``train.schedule``)."""

from __future__ import annotations

from typing import Any

import torch

from ddppipe.settings import run_spec


def optimizer_kernels(name: str, device: torch.device, sharded: bool = False) -> dict[str, bool]:
    """Fused optimizer kernels where they exist for ``name`` on ``device``.

    AdamW and SGD have fused kernels on GPUs and CPUs (one pass over all parameters); Adadelta
    has none, and its multi-tensor (foreach) version is slower on CPU than the default loop.
    ``sharded``: the parameters are FSDP2's DTensors, for which fused SGD has no sharding
    strategy (fused AdamW has one): SGD then takes its multi-tensor (foreach) kernels.
    """
    if name == "sgd" and sharded:
        return {"foreach": True}
    if name in ("adamw", "sgd"):
        return {"fused": True}
    if name == "adadelta" and device.type == "cuda":
        return {"foreach": True}
    return {}


def make_optimizer(
    params: Any, train: run_spec.Train, device: torch.device, sharded: bool = False
) -> torch.optim.Optimizer:
    """The recipe's optimizer (``train.optimizer``), for tasks without ``optimizer()``;
    ``sharded``: of a model FSDP2 sharded (:func:`optimizer_kernels`)."""
    name, lr, wd = train.optimizer, train.lr, train.weight_decay
    kernels = optimizer_kernels(name, device, sharded)
    if name == "adadelta":
        return torch.optim.Adadelta(params, lr=lr, weight_decay=wd, **kernels)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=wd, **kernels)
    if name == "sgd":
        return torch.optim.SGD(
            params, lr=lr, momentum=0.9, nesterov=True, weight_decay=wd, **kernels
        )
    raise ValueError(f"unknown optimizer {name!r}")


def make_scheduler(
    optimizer: torch.optim.Optimizer, train: run_spec.Train, steps_per_epoch: int
) -> torch.optim.lr_scheduler.LRScheduler:
    """A scheduler stepped once per optimizer step."""
    name = train.schedule
    if name == "step":
        return torch.optim.lr_scheduler.StepLR(optimizer, steps_per_epoch, gamma=train.gamma)
    if name == "onecycle":
        return torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=train.lr, total_steps=steps_per_epoch * train.epochs
        )
    if name == "constant":
        return torch.optim.lr_scheduler.ConstantLR(optimizer, factor=1.0, total_iters=0)
    raise ValueError(f"unknown schedule {name!r}")


def changes_lr(scheduler: torch.optim.lr_scheduler.LRScheduler) -> bool:
    """Whether stepping ``scheduler`` changes a learning rate: not a constant schedule's
    (``ConstantLR`` at factor 1), whose step only counts (15 Python calls: a short step's
    ~2 %; its saved state then says step 0, which resumes the same)."""
    constant = torch.optim.lr_scheduler.ConstantLR
    return not (isinstance(scheduler, constant) and scheduler.factor == 1.0)
