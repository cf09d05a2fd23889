"""One rank's training step: its loss weighted by its share of the global batch, so that the
update is the global batch's mean whatever the shares.

DDP averages the ranks' gradients (FSDP and HSDP reduce them as a mean too), which weighs the
ranks equally. An epoch's last batch splits unevenly (slices that differ by a sample), or
leaves some ranks without a sample (a stand-in counted 0: ``sharding.local_share``); each
rank's batch-mean loss is therefore weighted by :func:`loss_weight`, and the mean over the
ranks is the mean over the global batch: the update of one process on it.

In a world smaller than the run's (``slurm.min_nodes``) a rank's share comes in micro-steps,
the slices of the run's ranks it stands for (:func:`ddppipe.data.sharding.rank_share`): each
weighted the same way, their gradients accumulated, and reduced across the ranks once, at the
last (DDP's ``no_sync`` before it, FSDP2's gradient sync off): the update and the loss of the
run's world, each rank's batch as large as there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ddppipe.data import batches
from ddppipe.training.loop import evaluate, optim


def loss_weight(count: int, total: int, world_size: int) -> float:
    """The factor of a rank's batch-mean loss: its ``count`` samples of the global batch's
    ``total`` times ``world_size`` (the ranks' mean of the gradients divides by it again)."""
    return count * world_size / total


@dataclass(frozen=True)
class Stepper:
    """Trains a rank's :class:`batches.Share` of a step with ``net`` (DDP's wrapper or the
    FSDP-sharded model) and its optimizer and schedule."""

    net: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    loss_fn: evaluate.LossFn
    dtype: torch.dtype
    memory_format: torch.memory_format
    world_size: int
    # False: a schedule whose step changes nothing (optim.changes_lr), not stepped
    steps_schedule: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "steps_schedule", optim.changes_lr(self.scheduler))

    def forward_backward(self, share: batches.Share) -> torch.Tensor:
        """Forward and backward (the gradients' collectives with it), of each micro-step in
        turn where the share has them; the batch-mean loss of its samples that count."""
        if not share.parts:
            return self._micro_step(share.batch, share.count, share.total)
        x, y = share.batch
        sizes = [n for n, _ in share.parts]
        last = len(sizes) - 1
        losses = []
        for j, (xj, yj, (_, count)) in enumerate(
            zip(x.split(sizes), y.split(sizes), share.parts, strict=True)
        ):
            with contextlib.nullcontext() if j == last else _unsynced(self.net):
                losses.append(self._micro_step((xj, yj), count, share.total) * count)
        return torch.stack(losses).sum() / share.count if share.count else losses[0]

    def _micro_step(self, batch: batches.Batch, count: int, total: int) -> torch.Tensor:
        """Forward and backward of ``batch``; its batch-mean loss. A stand-in's loss is
        weighted 0: the rank joins the collectives, its gradients 0."""
        loss = evaluate.loss_of(self.net, batch, self.loss_fn, self.dtype, self.memory_format)
        weight = loss_weight(count, total, self.world_size)
        (loss if weight == 1 else loss * weight).backward()  # (1: an even share, no kernel)
        return loss.detach()

    def __call__(self, share: batches.Share) -> torch.Tensor:
        """Train one step; its batch-mean loss (its samples that count: ``share.count``)."""
        loss = self.forward_backward(share)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_schedule()
        return loss

    def step_schedule(self) -> None:
        """The schedule's step, after the optimizer's (none where it changes nothing)."""
        if self.steps_schedule:
            self.scheduler.step()


@contextlib.contextmanager
def _unsynced(net: nn.Module) -> Iterator[None]:
    """A micro-step before a step's last: its gradients accumulated on the rank, not reduced
    (DDP's ``no_sync``, FSDP2's ``set_requires_gradient_sync``; a model with neither: one rank,
    nothing to reduce)."""
    if hasattr(net, "no_sync"):
        with net.no_sync():
            yield
    elif hasattr(net, "set_requires_gradient_sync"):
        net.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            net.set_requires_gradient_sync(True)
    else:
        yield
