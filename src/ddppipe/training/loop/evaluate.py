"""Test-set evaluation of any task: sums over samples, added across ranks, then averaged.

By default (classification: integer targets, 2-D outputs) the sums are the loss and the
correct predictions, plus the confusion matrix; a task's ``metrics(output, target)`` hook
replaces them with its own sums. Each reported ``test_<name>`` is its sum over the whole
test set divided by the number of test samples.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ddppipe.core import system
from ddppipe.data import sharding
from ddppipe.settings import run_spec

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
MetricsFn = Callable[[torch.Tensor, torch.Tensor], dict[str, torch.Tensor]]


@dataclass
class Counts:
    """Sums over evaluated samples; add them across ranks with :meth:`all_reduce`."""

    sums: dict[str, torch.Tensor] = field(default_factory=dict)  # float64 scalars
    count: int = 0
    confusion: torch.Tensor | None = None  # (true, predicted), int64

    def add(self, sums: dict[str, torch.Tensor], n: int, confusion: torch.Tensor | None) -> None:
        for key, value in sums.items():
            value = value.detach().double().sum()
            self.sums[key] = self.sums[key] + value if key in self.sums else value
        self.count += n
        if confusion is not None:
            self.confusion = confusion if self.confusion is None else self.confusion + confusion

    @property
    def loss(self) -> float:
        return self.mean("loss")

    @property
    def accuracy(self) -> float | None:
        return self.mean("correct") if "correct" in self.sums else None

    def mean(self, key: str) -> float:
        return float(self.sums[key]) / max(self.count, 1)

    def per_class_accuracy(self) -> list[float] | None:
        if self.confusion is None:
            return None
        totals = self.confusion.sum(dim=1).clamp(min=1)
        return (self.confusion.diag().double() / totals).tolist()

    def all_reduce(self) -> Counts:
        """Sum over all ranks of the default process group (in place, on every rank)."""
        keys = sorted(self.sums)
        parts = [torch.stack([self.sums[k] for k in keys]).cpu() if keys else torch.zeros(0),
                 torch.tensor([float(self.count)], dtype=torch.float64)]  # fmt: skip
        if self.confusion is not None:
            parts.append(self.confusion.double().flatten().cpu())
        from ddppipe.parallel import distributed

        packed = torch.cat([p.double() for p in parts]).to(distributed.collective_device())
        dist.all_reduce(packed)
        packed = packed.cpu()
        self.sums = {k: packed[i] for i, k in enumerate(keys)}
        self.count = int(packed[len(keys)].round())
        if self.confusion is not None:
            shape = self.confusion.shape
            self.confusion = packed[len(keys) + 1 :].round().long().reshape(shape)
        return self

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {f"test_{k}": self.mean(k) for k in sorted(self.sums)}
        if "correct" in self.sums:
            out["test_accuracy"] = out.pop("test_correct")
        out["test_count"] = self.count
        if self.confusion is not None:
            out["per_class_accuracy"] = self.per_class_accuracy()
            out["confusion_matrix"] = self.confusion.tolist()
        return out


def is_classification(output: torch.Tensor, target: torch.Tensor) -> bool:
    return output.dim() == 2 and target.dim() == 1 and not target.is_floating_point()


def default_loss(label_smoothing: float = 0.0) -> LossFn:
    """Cross-entropy (batch mean), the default loss of a task without ``loss()``."""

    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output, target, label_smoothing=label_smoothing)

    return loss


def training_loss(task: Any, label_smoothing: float) -> LossFn:
    """What a task trains on: its ``loss()``, else the recipe's cross-entropy."""
    return task.module.loss if task.has("loss") else default_loss(label_smoothing)


def loss_of(
    model: Callable[[torch.Tensor], torch.Tensor], batch: tuple[torch.Tensor, torch.Tensor],
    loss_fn: LossFn, dtype: torch.dtype, memory_format: torch.memory_format,
) -> torch.Tensor:  # fmt: skip
    """The loss of a training batch: the forward under autocast to ``dtype`` (none in fp32),
    the input in ``memory_format``, the loss on float32 outputs."""
    x, y = batch
    # (fp32: no autocast context, whose entry and exit cost a short step 1 %)
    cast = contextlib.nullcontext() if dtype == torch.float32 else torch.autocast(
        x.device.type, dtype=dtype)  # fmt: skip
    with cast:
        output = model(as_input(x, memory_format))
    return loss_fn(output.float(), y)


def batch_sums(
    output: torch.Tensor, target: torch.Tensor, loss_fn: LossFn | None, metrics_fn: MetricsFn | None
) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """This batch's sums (and confusion matrix, for classification without ``metrics()``)."""
    output = output.float()
    n = target.shape[0]
    if metrics_fn is not None:
        sums = dict(metrics_fn(output, target))
        if "loss" not in sums and loss_fn is not None:
            sums["loss"] = loss_fn(output, target) * n
        return sums, None
    if not is_classification(output, target):
        return {"loss": loss_fn(output, target) * n}, None  # type: ignore[misc]
    loss = F.cross_entropy(output, target, reduction="sum") if loss_fn is None else (
        loss_fn(output, target) * n
    )  # fmt: skip
    predicted = output.argmax(1)
    classes = output.shape[1]
    confusion = torch.bincount(target * classes + predicted, minlength=classes * classes)
    return {"loss": loss, "correct": (predicted == target).sum()}, confusion.reshape(
        classes, classes
    )


def numerics(precision: str, channels_last: bool) -> tuple[torch.dtype, torch.memory_format]:
    """Autocast dtype and memory format of a training recipe's ``train.precision`` and
    ``train.channels_last`` (evaluation uses the same)."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    layout = torch.channels_last if channels_last else torch.contiguous_format
    return dtype, layout


def as_input(x: torch.Tensor, memory_format: torch.memory_format) -> torch.Tensor:
    """A batch in the recipe's layout (channels_last applies to image batches only)."""
    return x.contiguous(memory_format=memory_format) if x.dim() == 4 else x


@torch.no_grad()
def counts(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    dtype: torch.dtype = torch.float32,
    memory_format: torch.memory_format = torch.contiguous_format,
    loss_fn: LossFn | None = None,
    metrics_fn: MetricsFn | None = None,
    extra_forwards: int = 0,
) -> Counts:
    """Evaluate ``model`` on ``batches`` (already on the model's device); then run
    ``extra_forwards`` uncounted forwards of one sample (an FSDP model's forward is collective:
    a rank with fewer batches than the others keeps up with them)."""
    was_training = model.training
    model.eval()
    result = Counts()
    x = None
    for x, y in batches:
        device_type = x.device.type
        with torch.autocast(device_type, dtype=dtype, enabled=dtype != torch.float32):
            output = model(as_input(x, memory_format))
        sums, confusion = batch_sums(output, y, loss_fn, metrics_fn)
        result.add(sums, y.shape[0], confusion)
    for _ in range(extra_forwards if x is not None else 0):
        with torch.autocast(x.device.type, dtype=dtype, enabled=dtype != torch.float32):
            model(as_input(x[:1], memory_format))
    model.train(was_training)
    return result


def batch_count(n: int, rank: int, world_size: int, batch_size: int) -> int:
    """How many evaluation batches ``rank`` gets of a test set of ``n`` samples."""
    lo, hi = sharding.eval_range(n, rank, world_size)
    return -(-(hi - lo) // batch_size)


def evaluate_checkpoint(
    checkpoint: Path, spec: run_spec.RunSpec, data_dir: Path, batch_size: int
) -> dict[str, Any]:
    """Evaluate a final checkpoint's model on the task's test set, in this process.

    It runs with the training recipe's precision and layout, so its accuracy is the one the
    training run reported after its last epoch.
    """
    from ddppipe import tasks
    from ddppipe.data import batches, squashfs
    from ddppipe.training.checkpoints import checkpoint as ckpt

    snapshot = ckpt.load(checkpoint)
    task = tasks.load(spec.task, step="ddppipe evaluate")
    args = run_spec.plain(spec.task_args)  # a plain dict, as the task's hooks get it in training
    recipe = snapshot["meta"]["train"]  # the recipe that trained (its config's train section)
    dtype, layout = numerics(recipe["precision"], recipe["channels_last"])
    # (the model too: it may read the task's folder, e.g. imagefolder's class folders)
    with squashfs.reading(data_dir, args) as args:  # a packed folder's image mounted meanwhile
        model = task.call("model", args).to(memory_format=layout)
        model.load_state_dict(snapshot["model"])
        test = task.call("datasets", data_dir, args)[1]
        cpu = torch.device("cpu")
        workers = batches.loader_workers(spec.launch.loader_workers, test,
                                         system.available_cpus(), 1,
                                         torch.get_num_threads())  # fmt: skip
        feed = batches.Feed(test, cpu, workers)
        loss_fn = task.module.loss if task.has("loss") else None
        metrics_fn = task.module.metrics if task.has("metrics") else None
        batches = feed.shard(0, 1, batch_size)
        result = counts(model, batches, dtype, layout, loss_fn, metrics_fn).summary()
        result["precision"] = str(dtype).removeprefix("torch.")
        result["epochs"] = snapshot["epoch"]
        result["config_hash"] = snapshot["config_hash"]
        return result
