"""tinycnn: an example task file, written as a user would (imports only torch and numpy).

Run it with ``snakemake --cores all --config task=examples/tasks/tinycnn.py``.

The data is synthetic but has to be learned: noisy 16x16 grey images of a line, either
horizontal, vertical, diagonal or anti-diagonal, at a random place. ``prepare`` generates
them from ``task_args.seed`` and saves them as ``.npy`` files in the data folder (ddppipe
hashes whatever it leaves there into the run's data manifest). The last ``test_fraction``
of the images is the test set.

A task provides ``prepare``, ``datasets`` and ``model``; this one also shows the optional
``ARGS_SCHEMA`` (ddppipe validates ``task_args`` against it and fills in the defaults),
``loss`` (the batch mean that is back-propagated) and ``metrics`` (sums over a batch, which
ddppipe adds up over the whole test set and divides by its size).
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

CLASSES = ("horizontal", "vertical", "diagonal", "anti-diagonal")
SIZE = 16

ARGS_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "samples": {"type": "integer", "minimum": 100, "default": 4000},
        "test_fraction": {"type": "number", "exclusiveMinimum": 0, "maximum": 0.5, "default": 0.2},
        "noise": {"type": "number", "minimum": 0, "default": 0.5},
        "seed": {"type": "integer", "default": 0},
        "width": {"type": "integer", "minimum": 1, "default": 16},
    },
}


def _generate(samples: int, noise: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Images (N, 1, 16, 16) float32 and labels (N,) int64, the same for the same seed."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, len(CLASSES), samples)
    offsets = rng.integers(-SIZE // 2 + 2, SIZE // 2 - 1, samples)
    images = rng.normal(0.0, noise, (samples, SIZE, SIZE)).astype(np.float32)
    for image, label, offset in zip(images, labels, offsets, strict=True):
        if label == 0:
            image[SIZE // 2 + offset, :] += 1.0
        elif label == 1:
            image[:, SIZE // 2 + offset] += 1.0
        elif label == 2:
            image += np.eye(SIZE, k=offset, dtype=np.float32)
        else:
            image += np.fliplr(np.eye(SIZE, k=offset, dtype=np.float32))
    return images[:, None], labels.astype(np.int64)


def _save(path: Path, array: np.ndarray) -> None:
    """Write ``array`` to ``path`` atomically, and only when its content changes."""
    buffer = io.BytesIO()
    np.save(buffer, array)
    data = buffer.getvalue()
    if path.is_file() and path.read_bytes() == data:
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)  # readers see the old file or the new one, never half of one


def prepare(data_dir: Path, args: dict[str, Any]) -> None:
    data_dir.mkdir(parents=True, exist_ok=True)
    images, labels = _generate(args["samples"], args["noise"], args["seed"])
    _save(data_dir / "images.npy", images)
    _save(data_dir / "labels.npy", labels)


def datasets(data_dir: Path, args: dict[str, Any]) -> tuple[TensorDataset, TensorDataset]:
    images = torch.from_numpy(np.load(data_dir / "images.npy"))
    labels = torch.from_numpy(np.load(data_dir / "labels.npy"))
    n_test = round(len(labels) * args["test_fraction"])
    train = TensorDataset(images[:-n_test], labels[:-n_test])
    test = TensorDataset(images[-n_test:], labels[-n_test:])
    return train, test


class TinyCNN(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # 16 -> 8
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # 8 -> 4
        )  # fmt: skip
        self.classifier = nn.Linear(2 * width * 4 * 4, len(CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).flatten(1))


def model(args: dict[str, Any]) -> nn.Module:
    return TinyCNN(args["width"])


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy with a little label smoothing: the batch mean."""
    return F.cross_entropy(output, target, label_smoothing=0.05)


def metrics(output: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sums over the batch; ddppipe reports them divided by the number of test images."""
    top2 = output.topk(2, dim=1).indices
    return {
        "loss": F.cross_entropy(output.float(), target, reduction="sum"),
        "accuracy": (output.argmax(1) == target).sum(),
        "top2_accuracy": (top2 == target[:, None]).any(1).sum(),
    }
