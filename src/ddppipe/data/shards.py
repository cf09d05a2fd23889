"""Samples in tar shards, streamed: data larger than a node's memory or disk, read in order.

A task's ``prepare`` writes its samples with :class:`Writer` into shards of a few hundred
MB (``<base>-000000.tar``, ...: plain tar files, one member per field of a sample, as
WebDataset writes them) and an index (``<base>.shards.json`` and ``<base>.offsets.npy``:
each sample's shard, and each field's offset and size in it). ``datasets`` returns
:class:`Sharded`, which decodes a sample's fields with the task's ``decode``.

The data order stays ``ddppipe.data.sharding``'s contract, so every sample is trained once an
epoch and a run stopped mid-epoch continues at any world size and DataLoader worker count:
an epoch's global order is a function of the seed and the epoch alone (:meth:`Sharded.order`:
the shards shuffled, then the samples shuffled within windows of ``window`` consecutive
samples of that shard order, the shuffle buffer). Step k trains ``order[k*B:(k+1)*B]``, each
rank a contiguous slice of it. A rank's batches are read by its DataLoader workers
(:mod:`ddppipe.data.loader`): the rank groups its consecutive batches into requests that fill
a worker's share of a window, and the worker that takes a request reads its samples shard by
shard in file order (one open a shard, forward seeks), then decodes them batch by batch. A
window spans a few shards: a rank reads a few shards at a time, each sequentially, and holds
about its share of a window (each worker one request, and the request it trains on).
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from torch.utils.data import Dataset

from ddppipe.core import atomic
from ddppipe.core.errors import UserError

INDEX = ".shards.json"
OFFSETS = ".offsets.npy"
FORMAT = 1
Sample = dict[str, bytes]


class ShardError(RuntimeError, UserError):
    """Shards that cannot be written or read as asked."""


def index_paths(base: Path) -> tuple[Path, Path]:
    """The shard list's and the offsets' files of the shards named ``base``."""
    return base.with_name(base.name + INDEX), base.with_name(base.name + OFFSETS)


def shard_path(base: Path, number: int) -> Path:
    return base.with_name(f"{base.name}-{number:06d}.tar")


class Writer:
    """Write samples (a field's extension -> its bytes, the same fields for every sample) into
    shards of ``shard_bytes`` or less (a sample larger than that gets a shard of its own).

    Use as a context manager: each shard is written beside its destination and renamed into
    place when full; the index is written last, on a clean exit. On an error, or at a clean
    exit for shards of an earlier, larger write, the files of ``base`` not in the new index
    are removed: no half-written data is left, and none of another write mixes in. Write the
    samples in a random order when the source is sorted (by class, say): the epoch's shuffle
    mixes samples within windows of consecutive samples, not across the whole set.
    """

    def __init__(self, base: Path, shard_bytes: int = 256 << 20) -> None:
        self.base, self.shard_bytes = Path(base), shard_bytes
        self.fields: list[str] | None = None
        self.shards: list[dict[str, Any]] = []
        self.offsets: list[list[tuple[int, int]]] = []
        self._tar: tarfile.TarFile | None = None
        self._file: BinaryIO
        self._tmp: Path | None = None
        self._count = 0

    def __enter__(self) -> Writer:
        self.base.parent.mkdir(parents=True, exist_ok=True)
        for path in index_paths(self.base):  # until the new one: no index of half the shards
            path.unlink(missing_ok=True)
        return self

    def write(self, sample: Mapping[str, bytes]) -> None:
        """Append one sample; its key is its number (``000000042.png``, ...)."""
        fields = sorted(sample)
        if self.fields is None:
            if not fields or any(not f or "." in f or "/" in f for f in fields):
                raise ShardError(f"shards {self.base}: fields {fields} must be non-empty "
                                 "extensions without '.' or '/' (png, cls, json)")  # fmt: skip
            self.fields = fields
        elif fields != self.fields:
            raise ShardError(
                f"shards {self.base}: sample {len(self.offsets)} has fields {fields}, the "
                f"first had {self.fields}: every sample the same"
            )
        size = sum(len(sample[f]) + 1024 for f in fields)
        if self._tar is None or (self._count and self._tar.offset + size > self.shard_bytes):
            self._next_shard()
        assert self._tar is not None
        key, places = f"{len(self.offsets):09d}", []
        for field in fields:
            data = bytes(sample[field])
            info = tarfile.TarInfo(f"{key}.{field}")
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            places.append((self._tar.offset + 512, len(data)))  # after its 512-byte header
            self._tar.addfile(info, io.BytesIO(data))
        self.offsets.append(places)
        self._count += 1

    def _next_shard(self) -> None:
        self._close_shard()
        final = shard_path(self.base, len(self.shards))
        self._tmp = final.with_name(f".{final.name}.writing.tmp")  # (atomic's temporary name)
        self._file = open(self._tmp, "wb")  # noqa: SIM115 (closed with its shard)
        self._tar = tarfile.open(  # noqa: SIM115
            fileobj=self._file, mode="w", format=tarfile.USTAR_FORMAT
        )
        self._count = 0

    def _close_shard(self) -> None:
        if self._tar is None or self._tmp is None:
            return
        self._tar.close()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        final = shard_path(self.base, len(self.shards))
        os.replace(self._tmp, final)
        self.shards.append({"name": final.name, "count": self._count,
                            "bytes": final.stat().st_size})  # fmt: skip
        self._tar, self._tmp = None, None

    def __exit__(self, kind: Any, error: Any, tb: Any) -> None:
        if kind is not None:
            if self._tar is not None:
                self._file.close()
            self.shards = []  # nothing of this write stays
            self._remove_others()
            return
        self._close_shard()
        if not self.shards:
            raise ShardError(f"shards {self.base}: no sample written")
        shard_list, offsets = index_paths(self.base)
        array = np.asarray(self.offsets, dtype=np.int64)  # (samples, fields, 2)
        with atomic.atomic_path(offsets) as tmp, open(tmp, "wb") as f:
            np.save(f, array)
        atomic.write_json(shard_list, {"format": FORMAT, "fields": self.fields,
                                       "shards": self.shards})  # fmt: skip
        self._remove_others()

    def _remove_others(self) -> None:
        keep = {s["name"] for s in self.shards}
        pattern = f"{self.base.name}-[0-9][0-9][0-9][0-9][0-9][0-9].tar"
        for path in [*self.base.parent.glob(pattern), *self.base.parent.glob(f".{pattern}.*")]:
            if path.name not in keep:
                path.unlink(missing_ok=True)
        if not keep:
            for path in index_paths(self.base):
                path.unlink(missing_ok=True)


class Sharded(Dataset):
    """The shards named ``base`` as a dataset of ``decode(sample)`` (the sample's fields by
    extension -> ``(input, target)``). ``window``: the shuffle buffer, in samples (see the
    module's docstring); the larger, the closer an epoch's order is to a full shuffle, and the
    more of its share of it a rank reads before its first step."""

    def __init__(
        self,
        base: Path,
        decode: Callable[[Sample], tuple[Any, Any]],
        window: int = 8192,
    ) -> None:
        self.base, self.decode, self.window = Path(base), decode, window
        shard_list, offsets = index_paths(self.base)
        try:
            listing = json.loads(shard_list.read_text())
        except FileNotFoundError:
            raise ShardError(f"{shard_list} missing: no shards were written as {self.base} "
                             "(the task's prepare writes them with ddppipe.data.shards.Writer)"
                             ) from None  # fmt: skip
        if listing.get("format") != FORMAT:
            raise ShardError(f"{shard_list}: format {listing.get('format')}, this ddppipe "
                             f"reads {FORMAT}: prepare the data again")  # fmt: skip
        self.fields: list[str] = listing["fields"]
        self.shards: list[dict[str, Any]] = listing["shards"]
        counts = np.asarray([s["count"] for s in self.shards], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(counts)])  # shard i: [starts[i], starts[i+1])
        self.offsets = np.load(offsets, mmap_mode="r")
        if self.offsets.shape[0] != self.starts[-1]:
            raise ShardError(f"{offsets}: {self.offsets.shape[0]} samples, the shards hold "
                             f"{self.starts[-1]}: prepare the data again")  # fmt: skip

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "offsets": None}  # a worker maps the offsets itself

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.offsets = np.load(index_paths(self.base)[1], mmap_mode="r")

    def order(self, seed: int, epoch: int) -> torch.Tensor:
        """The epoch's global order: shards shuffled, samples shuffled within each window."""
        generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        stream = torch.cat([
            torch.arange(int(self.starts[s]), int(self.starts[s + 1]))
            for s in torch.randperm(len(self.shards), generator=generator).tolist()
        ])  # fmt: skip
        for lo in range(0, len(stream), self.window):
            part = stream[lo : lo + self.window]
            stream[lo : lo + self.window] = part[torch.randperm(len(part), generator=generator)]
        return stream

    def read(self, indices: Sequence[int]) -> dict[int, Sample]:
        """The fields of samples ``indices``, read shard by shard in file order."""
        wanted = np.unique(np.asarray(indices, dtype=np.int64))
        shard_of = np.searchsorted(self.starts, wanted, side="right") - 1
        out: dict[int, Sample] = {}
        for shard in np.unique(shard_of).tolist():
            path = self.base.with_name(self.shards[shard]["name"])
            with open(path, "rb", buffering=0) as f:
                for i in wanted[shard_of == shard].tolist():  # ascending: forward seeks
                    out[i] = self._fields(f, i)
        return out

    def _fields(self, f: BinaryIO, i: int) -> Sample:
        places = self.offsets[i]
        lo, hi = int(places[0][0]), int(places[-1][0] + places[-1][1])
        f.seek(lo)
        blob = f.read(hi - lo)  # the sample's fields and the headers between them: one read
        return {field: blob[int(o) - lo : int(o) - lo + int(n)]
                for field, (o, n) in zip(self.fields, places, strict=True)}  # fmt: skip

    def __getitem__(self, i: int) -> tuple[Any, Any]:
        return self.decode(self.read([i])[i])


def is_sharded(dataset: Any) -> bool:
    return isinstance(dataset, Sharded)
