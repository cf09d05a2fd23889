"""The MNIST dataset as in-memory tensors, loaded from verified IDX files."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ddppipe.data import idx

if TYPE_CHECKING:  # file names and shapes (the download) need no torch
    import torch

TRAIN_IMAGES = "train-images-idx3-ubyte"
TRAIN_LABELS = "train-labels-idx1-ubyte"
TEST_IMAGES = "t10k-images-idx3-ubyte"
TEST_LABELS = "t10k-labels-idx1-ubyte"
FILES = (TRAIN_IMAGES, TRAIN_LABELS, TEST_IMAGES, TEST_LABELS)
# Mean and standard deviation of the training pixels (scaled to [0, 1]).
MEAN, STD = 0.1307, 0.3081


def expected_ndim(name: str) -> int:
    """Number of IDX dimensions a file of this name must have."""
    return idx.IMAGES_NDIM if "images" in name else idx.LABELS_NDIM


@dataclass(frozen=True)
class Split:
    """Images (N, 28, 28) uint8 and labels (N,) int64, on one device."""

    images: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return self.labels.shape[0]

    def to(self, device: torch.device) -> Split:
        return Split(self.images.to(device), self.labels.to(device))


@dataclass(frozen=True)
class Mnist:
    train: Split
    test: Split

    def to(self, device: torch.device) -> Mnist:
        return Mnist(self.train.to(device), self.test.to(device))


def _split(data_dir: Path, images_name: str, labels_name: str) -> Split:
    images = idx.read(data_dir / images_name, idx.IMAGES_NDIM)
    labels = idx.read(data_dir / labels_name, idx.LABELS_NDIM)
    if images.shape[0] != labels.shape[0]:
        raise idx.IdxError(
            f"{data_dir / labels_name}: wrong count: expected {images.shape[0]} labels "
            f"(one per image in {images_name}), got {labels.shape[0]}"
        )
    return Split(images, labels.long())


def load(data_dir: str | Path) -> Mnist:
    """Load the four IDX files of ``data_dir`` into memory."""
    data_dir = Path(data_dir)
    missing = [name for name in FILES if not (data_dir / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"MNIST files missing in {data_dir}: {', '.join(missing)}; "
            "run the download_mnist rule (or `ddppipe download`) first"
        )
    return Mnist(
        _split(data_dir, TRAIN_IMAGES, TRAIN_LABELS), _split(data_dir, TEST_IMAGES, TEST_LABELS)
    )


def normalize(images: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """uint8 (N, 28, 28) -> normalized float (N, 1, 28, 28), float32 unless ``dtype``."""
    import torch

    x = images.unsqueeze(1).to(dtype or torch.float32)
    return x.mul_(1.0 / (255.0 * STD)).sub_(MEAN / STD)
