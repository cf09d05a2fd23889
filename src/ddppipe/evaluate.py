"""Test-set evaluation: loss, accuracy, per-class accuracy and confusion matrix."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ddppipe import idx, mnist
from ddppipe.mnist import Split


@dataclass
class Counts:
    """Sums over evaluated samples; add them across ranks with :meth:`all_reduce`."""

    loss_sum: torch.Tensor
    confusion: torch.Tensor  # (true, predicted), int64

    @property
    def count(self) -> int:
        return int(self.confusion.sum())

    @property
    def loss(self) -> float:
        return float(self.loss_sum) / max(self.count, 1)

    @property
    def accuracy(self) -> float:
        return float(self.confusion.diag().sum()) / max(self.count, 1)

    def per_class_accuracy(self) -> list[float]:
        totals = self.confusion.sum(dim=1).clamp(min=1)
        return (self.confusion.diag().double() / totals).tolist()

    def all_reduce(self) -> Counts:
        """Sum counts over all ranks of the default process group (in place)."""
        packed = torch.cat([self.loss_sum.double().reshape(1), self.confusion.double().flatten()])
        dist.all_reduce(packed)
        self.loss_sum = packed[0]
        self.confusion = packed[1:].round().long().reshape(self.confusion.shape)
        return self

    def summary(self) -> dict[str, Any]:
        return {
            "test_loss": self.loss,
            "test_accuracy": self.accuracy,
            "test_count": self.count,
            "per_class_accuracy": self.per_class_accuracy(),
            "confusion_matrix": self.confusion.tolist(),
        }


@torch.no_grad()
def counts(
    model: nn.Module,
    split: Split,
    batch_size: int,
    dtype: torch.dtype = torch.float32,
    memory_format: torch.memory_format = torch.contiguous_format,
) -> Counts:
    """Evaluate ``model`` on all of ``split`` (already on the model's device)."""
    was_training = model.training
    model.eval()
    device = split.images.device
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    confusion = torch.zeros(idx.NUM_CLASSES * idx.NUM_CLASSES, dtype=torch.long, device=device)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    for start in range(0, len(split), batch_size):
        x = mnist.normalize(split.images[start : start + batch_size])
        y = split.labels[start : start + batch_size]
        with autocast:
            logits = model(x.contiguous(memory_format=memory_format))
        loss_sum += F.cross_entropy(logits.float(), y, reduction="sum")
        confusion += torch.bincount(
            y * idx.NUM_CLASSES + logits.argmax(1), minlength=idx.NUM_CLASSES**2
        )
    model.train(was_training)
    return Counts(loss_sum.cpu(), confusion.reshape(idx.NUM_CLASSES, -1).cpu())


def numerics(train: dict[str, Any]) -> tuple[torch.dtype, torch.memory_format]:
    """Autocast dtype and memory format of a training recipe (evaluation uses the same)."""
    dtype = torch.bfloat16 if train.get("precision") == "bf16" else torch.float32
    layout = torch.channels_last if train.get("channels_last") else torch.contiguous_format
    return dtype, layout


def evaluate_checkpoint(checkpoint: Path, data_dir: Path, batch_size: int) -> dict[str, Any]:
    """Evaluate a checkpoint's model on the test split of ``data_dir``.

    It runs with the training recipe's precision and layout, so its accuracy is the one the
    training run reported after its last epoch.
    """
    from ddppipe import checkpoint as ckpt
    from ddppipe.model import Net

    snapshot = ckpt.load(checkpoint)
    dtype, layout = numerics(snapshot["meta"]["train"])
    model = Net().to(memory_format=layout)
    model.load_state_dict(snapshot["model"])
    test = mnist.load(data_dir).test
    result = counts(model, test, batch_size, dtype, layout).summary()
    result["precision"] = str(dtype).removeprefix("torch.")
    result["epochs"] = snapshot["epoch"]
    result["config_hash"] = snapshot["config_hash"]
    return result
