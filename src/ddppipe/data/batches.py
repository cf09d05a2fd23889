"""Feeding a task's datasets to the ranks: gathered a batch at a time in the rank (tensors in
memory: :class:`Tensors`, a ``TensorDataset``, any dataset that returns a batch for a list of
indices: ``__getitems__``; :func:`batched`), or through a sharded DataLoader whose workers a
rank keeps for the slot (:mod:`ddppipe.data.loader`) (of a dataset read item by item, of a
pack: :mod:`ddppipe.data.packed`, a batch per read, or of shards streamed:
:mod:`ddppipe.data.shards`).

Every path follows :mod:`ddppipe.data.sharding`'s order: step k of an epoch trains the global
batch ``perm[k*B:(k+1)*B]`` of that epoch's order (a permutation; for shards, theirs), each
rank a contiguous slice of it, so a run resumed in the middle of an epoch (at any world size
and worker count) trains the same samples as an uninterrupted one, every sample once per epoch.
A step's :class:`Share` says how many of a rank's samples count (none for the stand-in of a
rank an epoch's last batch has no sample for: :func:`sharding.local_share`) and how many the
global batch holds: the training weights each rank's loss by them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.utils.data import Dataset, Subset, TensorDataset, default_collate

from ddppipe.data import loader, packed, sharding, shards

Batch = tuple[torch.Tensor, torch.Tensor]


class Share(NamedTuple):
    """A rank's part of one training step: its ``batch``, how many of its samples ``count``
    (0: a stand-in, :func:`sharding.local_share`) and the global batch's size ``total``; in a
    world smaller than the run's, its micro-steps' ``parts`` ((samples, counted) each, in the
    batch's order: :func:`sharding.rank_share`; (): one step)."""

    batch: Batch
    count: int
    total: int
    parts: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class Tensors(Dataset):
    """A dataset small enough for memory: ``inputs[i]``, ``targets[i]``, indexed on the device.

    ``transform`` maps a batch of inputs to what the model takes (e.g. uint8 images to
    normalized floats), on the device, once per batch: no per-sample Python.
    """

    inputs: torch.Tensor
    targets: torch.Tensor
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if self.inputs.shape[0] != self.targets.shape[0]:
            raise ValueError(
                f"Tensors: {self.inputs.shape[0]} inputs but {self.targets.shape[0]} targets"
            )

    def __len__(self) -> int:
        return self.targets.shape[0]

    def __getitem__(self, i: int) -> Batch:
        x, y = self.batch(torch.tensor([i], device=self.inputs.device))
        return x[0], y[0]

    def to(self, device: torch.device) -> Tensors:
        """These tensors on ``device`` where they fit (a GPU's free memory, a quarter of it
        at most: the training's own comes first); else kept in host memory, pinned for the
        GPU, each batch copied over as it is gathered."""
        nbytes = sum(t.numel() * t.element_size() for t in (self.inputs, self.targets))
        if device.type == "cuda" and nbytes > torch.cuda.mem_get_info(device)[0] // 4:
            return Tensors(self.inputs.pin_memory(), self.targets.pin_memory(), self.transform)
        return Tensors(self.inputs.to(device), self.targets.to(device), self.transform)

    def batch(self, indices: torch.Tensor) -> Batch:
        indices = indices.to(self.inputs.device)
        x = self.inputs[indices]
        return (self.transform(x) if self.transform else x), self.targets[indices]

    def subset(self, indices: torch.Tensor) -> Tensors:
        return Tensors(self.inputs[indices], self.targets[indices], self.transform)


class Gathered:
    """A dataset that returns a batch for a list of indices (``__getitems__``: a batch of
    ``(inputs, targets)``, or a list of samples, collated here), asked in the rank."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def to(self, device: torch.device) -> Gathered:
        return self  # (each batch is moved where it trains)

    def batch(self, indices: torch.Tensor) -> Batch:
        data = self.dataset.__getitems__(indices.tolist())
        if isinstance(data, tuple | list) and len(data) == 2 and all(
            isinstance(part, torch.Tensor) and len(part) == len(indices) for part in data
        ):  # fmt: skip
            return data[0], data[1]
        x, y = default_collate(list(data))
        return x, y


def batched(dataset: Any) -> Tensors | Gathered | None:
    """``dataset`` as a rank gathers it a batch at a time, with no DataLoader workers: tensors
    in memory (:class:`Tensors`, a ``TensorDataset`` of inputs and targets, a ``Subset`` of
    either), or a dataset that returns a batch for a list of indices (``__getitems__``); None
    for one read item by item (files decoded in ``__getitem__``), and ddppipe's own readers of
    files (a pack, shards), whose workers read beside the training."""
    if isinstance(dataset, Tensors | Gathered):
        return dataset
    if isinstance(dataset, TensorDataset) and len(dataset.tensors) == 2:
        return Tensors(*dataset.tensors)
    if isinstance(dataset, Subset):  # (whose __getitems__ reads item by item when its own does)
        inner = batched(dataset.dataset)
        if isinstance(inner, Tensors):
            return inner.subset(torch.as_tensor(dataset.indices, dtype=torch.long))
        return None if inner is None else Gathered(dataset)
    if packed.is_packed(dataset) or shards.is_sharded(dataset):
        return None
    return Gathered(dataset) if callable(getattr(dataset, "__getitems__", None)) else None


def in_memory(dataset: Any) -> bool:
    """Whether a task's dataset is gathered a batch at a time in the rank (:func:`batched`;
    a Subset's answer is its dataset's, without copying its share of the tensors)."""
    if isinstance(dataset, Subset):
        return in_memory(dataset.dataset)
    return batched(dataset) is not None


def samples(dataset: Any, n: int, device: torch.device) -> Batch:
    """The first ``n`` samples of a task's dataset as one batch on ``device``."""
    if (gathered := batched(dataset)) is not None:
        x, y = gathered.batch(torch.arange(n))
    else:
        x, y = default_collate([dataset[i] for i in range(n)])
    return x.to(device), y.to(device)


def loader_workers(setting: int | None, dataset: Any, cpus: int, local_world_size: int,
                   threads: int) -> int:  # fmt: skip
    """DataLoader workers of a process for ``dataset``: ``setting`` (``launch.loader_workers``)
    when set; else none for tensors in memory (nothing to load), and for a dataset read item
    by item (files decoded in ``__getitem__``) the CPUs of the process's share of the node
    beside its compute threads, at least one: the items are read beside the training, never
    in its thread, on CPU and GPU nodes alike."""
    if setting is not None:
        return setting
    if in_memory(dataset):
        return 0
    return max(1, cpus // max(local_world_size, 1) - threads)


def epoch_order(dataset: Any, seed: int, epoch: int) -> torch.Tensor:
    """The global order of ``dataset``'s samples in ``epoch``: a permutation drawn from the seed
    and the epoch (:mod:`ddppipe.data.sharding`), or the shards' own (read in order)."""
    if shards.is_sharded(dataset):
        return dataset.order(seed, epoch)
    return sharding.epoch_permutation(len(dataset), seed, epoch)


class ShardedBatches:
    """Batch sampler: this rank's index lists of one epoch of ``order``, from ``start_step``."""

    def __init__(self, order: torch.Tensor, global_batch: int, rank: int, world_size: int,
                 start_step: int = 0, micro: int = 1) -> None:  # fmt: skip
        self.perm, n = order, len(order)
        self.global_batch, self.rank, self.world_size = global_batch, rank, world_size
        self.steps = sharding.steps_per_epoch(n, global_batch)
        self.start_step, self.micro = start_step, micro

    def __len__(self) -> int:
        return self.steps - self.start_step

    def _shares(self) -> Iterator[tuple[torch.Tensor, int, int, tuple[tuple[int, int], ...]]]:
        for step in range(self.start_step, self.steps):
            gbatch = sharding.global_batch(self.perm, step, self.global_batch)
            local, count, parts = sharding.rank_share(gbatch, self.rank, self.world_size,
                                                      self.micro)  # fmt: skip
            yield local, count, gbatch.numel(), parts

    def __iter__(self) -> Iterator[list[int]]:
        for local, _, _, _ in self._shares():
            yield local.tolist()

    def counts(self) -> Iterator[tuple[int, int, tuple[tuple[int, int], ...]]]:
        """(samples that count, global batch size, micro-steps) of each batch :meth:`__iter__`
        yields."""
        for _, count, total, parts in self._shares():
            yield count, total, parts


class Feed:
    """One rank's view of a dataset: batches of an epoch (training) or its shard (evaluation),
    gathered in the rank (:func:`batched`; no workers) or read by its :class:`loader.Loader`'s
    workers, kept from pass to pass. ``wait_bound``: the seconds the rank waits for a batch,
    from the longest wait it has seen (:func:`ddppipe.training.measuring.allowances.loader_wait_s`);
    ``seeded``: each batch's random draws seeded from the run's seed (``train.deterministic``)."""

    def __init__(
        self, dataset: Any, device: torch.device, workers: int, seeded: bool = False,
        wait_bound: Callable[[float | None], float] | None = None,
    ) -> None:  # fmt: skip
        gathered = batched(dataset)
        self.in_memory = gathered is not None
        self.dataset = gathered.to(device) if gathered is not None else dataset
        self.device, self.workers, self.seeded = device, workers, seeded
        self.wait_bound = wait_bound
        self._loader: loader.Loader | None = None

    def __len__(self) -> int:
        return len(self.dataset)

    @property
    def source(self) -> loader.Loader:
        """The dataset's loader, made at its first use (its workers forked by :meth:`start`, or
        at its first pass)."""
        if self._loader is None:
            # a shard's request is a window's share: one outstanding a worker (its memory)
            prefetch = 1 if shards.is_sharded(self.dataset) else 4
            self._loader = loader.Loader(self.dataset, self.workers, self.device.type == "cuda",
                                         prefetch, self.wait_bound)  # fmt: skip
        return self._loader

    def start(self) -> Feed:
        """Fork the loader's workers now, once for the slot (nothing to start in memory)."""
        if not self.in_memory:
            self.source.start()
        return self

    def _to_device(self, batch: Any) -> Batch:
        x, y = batch
        if self.device.type == "cpu":  # (where every batch is: no call a step)
            return x, y
        pinned = self.device.type == "cuda"  # the loader pins its batches for the GPU
        return x.to(self.device, non_blocking=pinned), y.to(self.device, non_blocking=pinned)

    def _gather(self, indices: torch.Tensor) -> Batch:
        """(In memory) the batch of ``indices``, on the rank's device."""
        return self._to_device(self.dataset.batch(indices))

    def epoch(self, seed: int, epoch: int, global_batch: int, rank: int, world_size: int,
              start_step: int, micro: int = 1) -> Iterator[Share]:  # fmt: skip
        """This rank's :class:`Share` of each step of ``epoch`` from ``start_step`` on, in
        ``micro`` micro-steps a step (:func:`sharding.micro_steps`)."""
        n = len(self.dataset)
        if self.in_memory:
            perm = sharding.epoch_permutation(n, seed, epoch)
            if isinstance(self.dataset, Tensors):  # indexed where they are (GPU or host)
                perm = perm.to(self.dataset.inputs.device)
            for step in range(start_step, sharding.steps_per_epoch(n, global_batch)):
                gbatch = sharding.global_batch(perm, step, global_batch)
                local, count, parts = sharding.rank_share(gbatch, rank, world_size, micro)
                yield Share(self._gather(local), count, gbatch.numel(), parts)
            return
        order = epoch_order(self.dataset, seed, epoch)
        sampler = ShardedBatches(order, global_batch, rank, world_size, start_step, micro)
        steps = range(start_step, sampler.steps)
        # (seeded in the workers only: the rank's own streams, its dropout's, stay its own)
        seeded = self.seeded and self.workers > 0
        keys = [loader.batch_key(seed, epoch, s, rank) if seeded else None for s in steps]
        # a shard's worker reads its share of a window at once
        share = self.dataset.window // (world_size * max(self.workers, 1)) if shards.is_sharded(
            self.dataset) else 0  # fmt: skip
        requests = _requests(list(zip(keys, sampler, strict=True)), share)
        what = f"rank {rank}, train epoch {epoch + 1}"
        batches = self.source.batches(requests, what)
        for batch, (count, total, parts) in zip(batches, sampler.counts(), strict=True):
            yield Share(self._to_device(batch), count, total, parts)

    def shard(self, rank: int, world_size: int, batch_size: int) -> Iterator[Batch]:
        """Batches of this rank's contiguous share (evaluation: every sample once overall)."""
        lo, hi = sharding.eval_range(len(self.dataset), rank, world_size)
        if self.in_memory:
            for start in range(lo, hi, batch_size):
                yield self._gather(torch.arange(start, min(start + batch_size, hi)))
            return
        parts = [(None, list(range(i, min(i + batch_size, hi)))) for i in range(lo, hi, batch_size)]
        share = self.dataset.window // max(self.workers, 1) if shards.is_sharded(
            self.dataset) else 0  # fmt: skip
        for batch in self.source.batches(_requests(parts, share), f"rank {rank}, evaluation"):
            yield self._to_device(batch)


def _requests(batches: list[tuple[int | None, list[int]]], share: int) -> list[loader.Request]:
    """Consecutive ``batches`` grouped into requests of at least ``share`` samples each (a
    shard's worker reads a request's samples at once), or one batch a request (``share`` 0)."""
    out: list[loader.Request] = []
    group: loader.Request = []
    for batch in batches:
        group.append(batch)
        if sum(len(b) for _, b in group) >= share:
            out.append(group)
            group = []
    return [*out, group] if group else out
