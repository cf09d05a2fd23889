"""Samples packed into one file: decoded once, fixed-layout, read memory-mapped.

A dataset of many small files costs one ``open`` (a metadata round trip on a parallel
filesystem) and one decode per sample per epoch. Packed, its samples are one NumPy ``.npy``
array of ``(count, *shape)`` (e.g. uint8 images, already resized), written once by a task's
``prepare`` into the data folder, with the labels in a second, small array. Training maps it
(``np.load(..., mmap_mode="r")``): a batch is one fancy index of rows in ascending order
(page-cache reads, no decode), larger than memory included. The order of the samples and
their split across ranks stay ``ddppipe.data.sharding``'s (any world size, any worker count).

Writing streams rows into a temporary ``.npy`` beside the destination and renames it (atomic):
an interrupted ``prepare`` leaves no half-written pack. ``reuse`` copies rows of an earlier
pack (unchanged samples) instead of decoding them again.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ddppipe.core import atomic

SUFFIX = ".npy"
LABELS = ".labels.npy"


def paths(base: Path) -> tuple[Path, Path]:
    """The samples' and the labels' files of the pack named ``base`` (no suffix)."""
    return base.with_name(base.name + SUFFIX), base.with_name(base.name + LABELS)


def write(
    base: Path,
    shape: Sequence[int],
    labels: Sequence[int],
    decode: Callable[[int], np.ndarray],
    reuse: dict[int, tuple[np.ndarray, int]] | None = None,
    workers: int = 1,
) -> int:
    """Write the pack ``base`` of ``len(labels)`` uint8 samples of ``shape``; return how many
    were decoded. Row ``i`` is ``decode(i)``, or row ``j`` of the earlier pack ``old`` where
    ``reuse[i] == (old, j)``. Rows are decoded by ``workers`` threads, in order, in chunks."""
    from concurrent.futures import ThreadPoolExecutor

    samples_path, labels_path = paths(base)
    count, reuse = len(labels), reuse or {}
    todo = [i for i in range(count) if i not in reuse]
    with atomic.atomic_path(samples_path) as tmp:
        out = np.lib.format.open_memmap(tmp, "w+", np.uint8, (count, *shape))
        for i, (old, j) in reuse.items():
            out[i] = old[j]
        with ThreadPoolExecutor(max(1, workers)) as pool:
            for lo in range(0, len(todo), 4096):
                chunk = todo[lo : lo + 4096]
                for i, row in zip(chunk, pool.map(decode, chunk), strict=True):
                    out[i] = row
        out.flush()
        del out
    atomic.write_bytes(labels_path, _npy(np.asarray(labels, dtype=np.int64)))
    return len(todo)


def _npy(array: np.ndarray) -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def rows(base: Path) -> np.ndarray:
    """The pack's samples, memory-mapped read-only."""
    return np.load(paths(base)[0], mmap_mode="r")


class Packed(Dataset):
    """A pack as a dataset of ``(transform(sample), label)``; ``transform`` maps a uint8
    tensor batch ``(n, *shape)`` to the model's input, once per batch.

    A DataLoader's fetch of a batch (``__getitems__``) reads its rows in ascending order in
    one index and returns the batch already stacked: the loader's ``collate_fn`` is then
    :func:`as_batch` (``ddppipe.data.batches`` gives it). The file is mapped in the process
    that reads it (each DataLoader worker maps its own)."""

    def __init__(
        self, base: Path, transform: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> None:
        self.base, self.transform = Path(base), transform
        self.labels = torch.from_numpy(np.load(paths(self.base)[1]))
        self._rows: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        return self.labels.shape[0]

    def _mapped(self) -> np.ndarray:
        if self._rows is None or self._rows[0] != os.getpid():
            self._rows = (os.getpid(), rows(self.base))
        return self._rows[1]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_rows": None}  # a spawned worker maps the file itself

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The samples ``indices`` as one batch (read in ascending order, returned in theirs)."""
        idx = np.asarray(indices, dtype=np.int64)
        order, mapped = np.argsort(idx, kind="stable"), self._mapped()
        x = np.empty((len(idx), *mapped.shape[1:]), dtype=np.uint8)
        x[order] = mapped[idx[order]]
        inputs = torch.from_numpy(x)
        return (self.transform(inputs) if self.transform else inputs), self.labels[idx]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.batch([i])
        return x[0], y[0]

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batch(indices)


def as_batch(fetched: Any) -> Any:
    """The DataLoader's ``collate_fn`` for a :class:`Packed` dataset: its batch is stacked."""
    return fetched


def is_packed(dataset: Any) -> bool:
    """Whether ``dataset`` (or the dataset a ``Subset`` wraps) is a :class:`Packed`."""
    while hasattr(dataset, "dataset") and hasattr(dataset, "indices"):
        dataset = dataset.dataset
    return isinstance(dataset, Packed)
