"""The training's data loader timed alone, without the model (``ddppipe time-loader``).

A run whose steps wait for their batches (the summary's ``data`` line) is data-bound; whether
the loader of a node can keep up at all is answered faster without training: this reads the
batches one rank of the run reads (its world size's share of epoch 0's global batches, the
same DataLoader workers, the data folder as given: loose files, a pack, shards or a staged
copy) and measures the first batch's wait (the workers' start and the first reads) and the
steady batches' rate. A training step shorter than a steady batch waits for its data.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ddppipe import tasks
from ddppipe.core import system
from ddppipe.data import batches, squashfs
from ddppipe.settings import run_spec
from ddppipe.settings.run_spec import RunSpec


@dataclass(frozen=True)
class LoaderTiming:
    """One rank's loader: how many batches of how many samples, with how many workers."""

    batches: int
    samples: int
    workers: int
    rank: int
    world_size: int
    first_batch_s: float
    steady_s: float  # the batches after the first

    @property
    def samples_per_s(self) -> float:
        steady = self.samples - self.samples // self.batches
        return steady / self.steady_s if self.steady_s > 0 else float("inf")

    @property
    def batch_ms(self) -> float:
        return 1000 * self.steady_s / max(self.batches - 1, 1)

    def line(self) -> str:
        return (
            f"loader of rank {self.rank} of {self.world_size} ({self.workers} DataLoader "
            f"worker(s)): {self.batches} batches, {self.samples} samples; first batch after "
            f"{self.first_batch_s:.2f} s, then {self.samples_per_s:,.0f} samples/s "
            f"({self.batch_ms:.1f} ms a batch): a training step shorter than that waits for "
            "its data"
        )


def time_loader(
    spec: RunSpec, data_dir: Path, steps: int, world_size: int, rank: int = 0
) -> LoaderTiming:
    """Read ``steps`` batches (at least 2) of rank ``rank``'s share of epoch 0 at
    ``world_size``, as the run's training reads them; the time of each part."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} of world size {world_size}: 0 <= rank < world size")
    task = tasks.load(spec.task, step="time-loader")
    args = run_spec.plain(spec.task_args)  # as training gives them (validated when resolved)
    with squashfs.reading(data_dir, args) as args:  # a packed folder's image mounted meanwhile
        train_set, _ = task.call("datasets", Path(data_dir), args)
        local = max(1, world_size // max(spec.launch.nnodes, 1))
        cpus, threads = system.available_cpus(), torch.get_num_threads()
        workers = batches.loader_workers(spec.launch.loader_workers, train_set, cpus, local,
                                         threads)  # fmt: skip
        feed = batches.Feed(train_set, torch.device("cpu"), workers)
        started = time.perf_counter()
        first = seen = samples = 0
        for share in feed.epoch(spec.train.seed, 0, spec.train.batch_size, rank, world_size, 0):
            seen, samples = seen + 1, samples + len(share.batch[1])
            if seen == 1:
                first = time.perf_counter()
            if seen == max(steps, 2):
                break
        done = time.perf_counter()
    return LoaderTiming(seen, samples, workers, rank, world_size, first - started, done - first)
