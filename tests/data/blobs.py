"""blobs: four Gaussian blobs in the plane, classified by a small MLP (a task file, written as
a user would; tests/test_sweep.py sweeps it).

``task_args``: ``hidden`` (16), the width of the hidden layer; ``activation`` ("relu"), the
name of a function of ``torch.nn.functional`` applied after it, looked up when the model runs
(a name it lacks fails at the first step); ``samples`` (512) and ``seed`` (0) of the data,
which ``prepare`` reads (``PREPARE_ARGS``); ``pause_s`` (0), seconds each training step
sleeps (a slower trial: the tests that time a sweep's slots).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ddppipe.data import Tensors

CENTRES = ((2.0, 2.0), (-2.0, 2.0), (-2.0, -2.0), (2.0, -2.0))
PREPARE_ARGS = ("samples", "seed")  # the task_args prepare() reads

ARGS_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "hidden": {"type": "integer", "minimum": 1, "default": 16},
        "activation": {"type": "string", "default": "relu"},
        "samples": {"type": "integer", "minimum": 8, "default": 512},
        "seed": {"type": "integer", "default": 0},
        "pause_s": {"type": "number", "minimum": 0, "default": 0},
    },
}


def prepare(data_dir: Path, args: dict[str, Any]) -> None:
    """Points around the four centres (standard deviation 1), the same for the same seed."""
    g = torch.Generator().manual_seed(args["seed"])
    labels = torch.randint(0, len(CENTRES), (args["samples"],), generator=g)
    points = torch.tensor(CENTRES)[labels] + torch.randn(args["samples"], 2, generator=g)
    path = data_dir / "blobs.pt"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save({"points": points, "labels": labels}, tmp)
    os.replace(tmp, path)


def datasets(data_dir: Path, args: dict[str, Any]) -> tuple[Tensors, Tensors]:
    """The last quarter of the points is the test set."""
    blobs = torch.load(data_dir / "blobs.pt")
    points, labels = blobs["points"], blobs["labels"]
    n_test = len(labels) // 4
    return Tensors(points[:-n_test], labels[:-n_test]), Tensors(points[-n_test:], labels[-n_test:])


class MLP(nn.Module):
    def __init__(self, hidden: int, activation: str, pause_s: float) -> None:
        super().__init__()
        self.pause_s = pause_s
        self.hidden = nn.Linear(2, hidden)
        self.out = nn.Linear(hidden, len(CENTRES))
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        activation = getattr(F, self.activation, None)
        if activation is None:
            raise ValueError(
                f"activation {self.activation!r}: torch.nn.functional has no such function"
            )
        if self.training and self.pause_s:
            time.sleep(self.pause_s)
        return self.out(activation(self.hidden(x)))


def model(args: dict[str, Any]) -> nn.Module:
    return MLP(args["hidden"], args["activation"], args["pause_s"])
