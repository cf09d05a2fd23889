"""One rank's training step: its loss weighted by its share of the global batch, so that the
update is the global batch's mean whatever the shares.

DDP averages the ranks' gradients (FSDP and HSDP reduce them as a mean too), which weighs the
ranks equally. An epoch's last batch splits unevenly (slices that differ by a sample), or
leaves some ranks without a sample (a stand-in counted 0: ``sharding.local_share``); each
rank's batch-mean loss is therefore weighted by :func:`loss_weight`, and the mean over the
ranks is the mean over the global batch: the update of one process on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ddppipe.data import batches
from ddppipe.training.loop import evaluate


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

    def forward_backward(self, share: batches.Share) -> torch.Tensor:
        """Forward and backward (the gradients' collectives with it); the batch-mean loss.
        A stand-in's loss is weighted 0: the rank joins the collectives, its gradients 0."""
        loss = evaluate.loss_of(self.net, share.batch, self.loss_fn, self.dtype,
                                self.memory_format)  # fmt: skip
        weight = loss_weight(share.count, share.total, self.world_size)
        (loss if weight == 1 else loss * weight).backward()  # (1: an even share, no kernel)
        return loss.detach()

    def __call__(self, share: batches.Share) -> torch.Tensor:
        """Train one step; its batch-mean loss (its samples that count: ``share.count``)."""
        loss = self.forward_backward(share)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return loss
