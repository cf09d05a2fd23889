"""blobsdep: four Gaussian blobs in the plane, a task whose module imports blobfmt.

blobfmt (a wheel the tests write: tests/local_wheel.py) is installed neither in the test
environment nor in ddppipe's image: the run lists it in ``container.requirements``, so every
step that imports this file runs in the image with the task's layer over it
(tests/test_task_layer.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import blobfmt
import torch
from torch import nn

from ddppipe.data import Tensors

CENTRES = ((3.0, 3.0), (-3.0, 3.0), (-3.0, -3.0), (3.0, -3.0))

ARGS_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "samples": {"type": "integer", "minimum": 8, "default": 2048},
        "seed": {"type": "integer", "default": 0},
    },
}


def prepare(data_dir: Path, args: dict[str, Any]) -> None:
    """Points around the four centres (standard deviation 0.5), the same for the same seed."""
    g = torch.Generator().manual_seed(args["seed"])
    labels = torch.randint(0, len(CENTRES), (args["samples"],), generator=g)
    points = torch.tensor(CENTRES)[labels] + 0.5 * torch.randn(args["samples"], 2, generator=g)
    path = data_dir / "blobs.pt"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save({"points": points, "labels": labels}, tmp)
    os.replace(tmp, path)
    size = blobfmt.naturalsize(path.stat().st_size)
    print(f"blobsdep: {blobfmt.intcomma(args['samples'])} points, {size}", file=sys.stderr)


def datasets(data_dir: Path, args: dict[str, Any]) -> tuple[Tensors, Tensors]:
    """The last quarter of the points is the test set."""
    blobs = torch.load(data_dir / "blobs.pt")
    points, labels = blobs["points"], blobs["labels"]
    n_test = len(labels) // 4
    return Tensors(points[:-n_test], labels[:-n_test]), Tensors(points[-n_test:], labels[-n_test:])


def model(args: dict[str, Any]) -> nn.Module:
    return nn.Sequential(nn.Linear(2, 32), nn.ReLU(), nn.Linear(32, len(CENTRES)))
