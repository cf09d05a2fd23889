"""The reproduction against the run: final weights bitwise (else each tensor's largest
difference), per-epoch losses and metrics, the final evaluation."""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddppipe.reproduce.source import Recorded

# Metrics lines' values that measure the machine, not the training.
TIMING = frozenset({"images_per_s", "epoch_seconds", "train_seconds", "time", "world_size"})


@dataclass(frozen=True)
class TensorDiff:
    """A tensor whose values differ: its name and largest absolute difference (inf: its shape
    or dtype differs, or it is on one side only)."""

    name: str
    largest: float


@dataclass(frozen=True)
class EpochDiff:
    """The first epoch whose numbers differ: the first of them (train_loss first)."""

    epoch: int
    key: str
    run: float | None
    again: float | None


@dataclass(frozen=True)
class Comparison:
    tensors: list[TensorDiff]  # empty: the weights are bitwise identical
    epoch: EpochDiff | None
    evaluation: list[str]  # the final evaluation's keys that differ

    @property
    def identical(self) -> bool:
        return not self.tensors and self.epoch is None and not self.evaluation


def weights(run: Path, again: Path) -> list[TensorDiff]:
    """The tensors of two weight files (``model.pt``) that are not bitwise equal."""
    import torch

    a = torch.load(run, map_location="cpu", weights_only=True)
    b = torch.load(again, map_location="cpu", weights_only=True)
    found = []
    for name in sorted(set(a) | set(b)):
        x, y = a.get(name), b.get(name)
        if x is None or y is None or x.shape != y.shape or x.dtype != y.dtype:
            found.append(TensorDiff(name, math.inf))
        elif not torch.equal(x, y):
            largest = (x.double() - y.double()).abs().max().item()
            found.append(TensorDiff(name, largest))
    return found


def _keys(line: dict[str, Any]) -> list[str]:
    numbers = [k for k, v in line.items() if isinstance(v, int | float) and k not in TIMING]
    return sorted(numbers, key=lambda k: (k != "train_loss", k))


def epochs(
    run: list[dict[str, Any]], again: list[dict[str, Any]], split: Collection[int] = ()
) -> EpochDiff | None:
    """The first epoch (1 = the first) where a loss or metric differs, or one side ends; the
    ``split`` epochs' train_loss (a slot resumed inside them) is not compared."""
    for i in range(max(len(run), len(again))):
        if i >= len(run) or i >= len(again):
            have = run[i] if i < len(run) else again[i]
            return EpochDiff(i + 1, "epochs", None if i >= len(run) else have.get("train_loss"),
                             None if i >= len(again) else have.get("train_loss"))  # fmt: skip
        for key in _keys(run[i]):
            if key == "train_loss" and i + 1 in split:
                continue
            if run[i][key] != again[i].get(key):
                return EpochDiff(i + 1, key, run[i][key], again[i].get(key))
    return None


def evaluation(run: dict[str, Any] | None, again: dict[str, Any] | None) -> list[str]:
    """The final evaluation's values that differ (the test set's metrics, its matrix)."""
    if run is None or again is None:
        return []
    skip = {"config_hash"}
    return sorted(k for k in set(run) | set(again) if k not in skip and run.get(k) != again.get(k))


def compare(run: Recorded, again: Recorded) -> Comparison:
    """The run and its reproduction."""
    return Comparison(
        weights(run.weights, again.weights),
        epochs(run.metrics, again.metrics, run.split_epochs),
        evaluation(run.evaluation, again.evaluation),
    )
