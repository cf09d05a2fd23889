"""scikit-learn's handwritten digits: 1,797 real 8x8 grey images of 0-9, trained by a small CNN.

The data ships inside scikit-learn's wheel (``sklearn.datasets.load_digits``): no download.
``prepare`` writes ``digits.pt`` into the data folder: uint8 images (N, 1, 8, 8) with values
0-16 and int64 labels, split into train and test by a seeded, stratified split (each class
contributes ``round(n * test_fraction)`` of its images to the test set). The file's bytes
depend only on the split arguments (and torch's file format): preparing again leaves it as
is. The images stay in memory (:class:`ddppipe.data.Tensors`) and are normalized per batch
on the device.

``task_args``:

- ``test_fraction`` (0.25): the share of every class held out for testing
  (450 of 1,797 images by default);
- ``split_seed`` (0): seed of the split;
- ``width`` (32): channels of the first convolution (the second has twice as many).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ddppipe.core import atomic
from ddppipe.data.batches import Tensors
from ddppipe.tasks.model import Dropout, flatten
from ddppipe.tasks.split import stratified

FILE = "digits.pt"
PREPARE_ARGS = ("test_fraction", "split_seed")  # what the split, and so the file, depends on
FORMAT = 1
# Mean and standard deviation of the pixels (scaled to [0, 1]) of all 1,797 images.
MEAN, STD = 0.3053, 0.3760

ARGS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "test_fraction": {
            "type": "number",
            "exclusiveMinimum": 0,
            "exclusiveMaximum": 1,
            "default": 0.25,
        },
        "split_seed": {"type": "integer", "minimum": 0, "default": 0},
        "width": {"type": "integer", "minimum": 1, "default": 32},
    },
}


def _contents(args: dict[str, Any]) -> bytes:
    """The bytes of ``digits.pt`` for these arguments (the same bytes every time)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.from_numpy(digits.images.astype(np.uint8)).unsqueeze(1)  # (N, 1, 8, 8)
    labels = torch.from_numpy(digits.target.astype(np.int64))
    test = torch.from_numpy(stratified(digits.target, args["test_fraction"],
                                             args["split_seed"]))  # fmt: skip
    is_test = torch.zeros(len(labels), dtype=torch.bool)
    is_test[test] = True
    split = {"test_fraction": float(args["test_fraction"]), "split_seed": int(args["split_seed"])}
    data = {
        "format": FORMAT,
        "split": split,
        "train_images": images[~is_test].clone(), "train_labels": labels[~is_test].clone(),
        "test_images": images[is_test].clone(), "test_labels": labels[is_test].clone(),
    }  # fmt: skip
    buffer = io.BytesIO()  # not the file: torch.save names its archive after the file
    torch.save(data, buffer)
    return buffer.getvalue()


def prepare(data_dir: Path, args: dict[str, Any]) -> None:
    """Write ``digits.pt`` (atomically; left untouched when it already holds these bytes)."""
    dest = Path(data_dir) / FILE
    contents = _contents(args)
    if dest.is_file() and dest.read_bytes() == contents:
        return
    atomic.write_bytes(dest, contents)


def normalize(images: torch.Tensor) -> torch.Tensor:
    """uint8 images (N, 1, 8, 8), values 0-16 -> normalized float32."""
    return images.float().mul_(1.0 / (16.0 * STD)).sub_(MEAN / STD)


def datasets(data_dir: Path, args: dict[str, Any]) -> tuple[Tensors, Tensors]:
    """The train and test splits in memory, normalized per batch."""
    path = Path(data_dir) / FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: run the task's prepare() first")
    data = torch.load(path, map_location="cpu", weights_only=True)
    split = {"test_fraction": float(args["test_fraction"]), "split_seed": int(args["split_seed"])}
    if data.get("format") != FORMAT or data.get("split") != split:
        raise ValueError(
            f"{path} holds split {data.get('split')} (format {data.get('format')}), not the "
            f"configured {split}: run the task's prepare() again"
        )
    return (
        Tensors(data["train_images"], data["train_labels"], normalize),
        Tensors(data["test_images"], data["test_labels"], normalize),
    )


class Net(nn.Module):
    """conv w -> conv 2w -> max-pool -> fc 128 -> dropout -> fc 10, for (N, 1, 8, 8) inputs."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.fc1 = nn.Linear(2 * width * 4 * 4, 128)
        self.dropout = Dropout(0.5)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits (N, 10)."""
        x = F.relu(self.conv1(x))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))  # = max_pool(relu(x)): both are monotone
        x = F.relu(self.fc1(flatten(x)))
        return self.fc2(self.dropout(x))


def model(args: dict[str, Any]) -> nn.Module:
    return Net(args["width"])
