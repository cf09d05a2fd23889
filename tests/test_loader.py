"""A rank's DataLoader (``ddppipe.data.loader``): its workers forked once and kept from epoch
to epoch and evaluation, the batches those of a loader without workers; a worker killed or
stopped named within the rank's bound (the rank, the pass, the worker and its state); the
bound derived from the waits the rank measured (``allowances.loader_wait_s``)."""

from __future__ import annotations

import contextlib
import functools
import os
import random
import signal
import time
from typing import Any

import numpy
import pytest
import torch
from torch.utils.data import Dataset, Subset, TensorDataset

from ddppipe.data import batches, loader
from ddppipe.training.measuring import allowances

CPU = torch.device("cpu")


class Items(Dataset):
    """A map-style dataset read item by item, as an image folder is (``broken``: item 50
    raises)."""

    def __init__(self, broken: bool = False) -> None:
        self.broken = broken

    def __len__(self) -> int:
        return 96

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if self.broken and i == 50:
            raise RuntimeError("a damaged image")
        return torch.full((3,), float(i)), i


class Draws(Dataset):
    """Items drawn in a worker: a random transform's torch, random and NumPy streams."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.tensor([torch.rand(()).item(), random.random(), numpy.random.rand()]), i


class Rows(Dataset):
    """Items(), also asked a batch at a time (``__getitems__``): as a batch of inputs and
    targets (``listed``: as a list of samples, as torch's own datasets answer)."""

    def __init__(self, listed: bool = False) -> None:
        self.listed, self.asked = listed, 0

    def __len__(self) -> int:
        return 96

    def __getitems__(self, indices: list[int]) -> Any:
        self.asked += 1
        if self.listed:
            return [(torch.full((3,), float(i)), i) for i in indices]
        return torch.tensor(indices).float()[:, None].expand(-1, 3), torch.tensor(indices)


def pids(feed: batches.Feed) -> list[int]:
    return [w.pid for w in feed.source.loader._iterator._workers]


def test_workers_are_forked_once_and_serve_every_epoch_and_evaluation() -> None:
    feed = batches.Feed(Items(), CPU, workers=2).start()
    forked = pids(feed)
    alone = batches.Feed(Items(), CPU, workers=0)
    for epoch in range(3):
        got = [y.tolist() for (_, y), *_ in feed.epoch(5, epoch, 8, 1, 2, 0)]
        assert got == [y.tolist() for (_, y), *_ in alone.epoch(5, epoch, 8, 1, 2, 0)]
        assert pids(feed) == forked
    # a run resumed at step 3 reads the uninterrupted run's batches from there on
    assert [y.tolist() for (_, y), *_ in feed.epoch(5, 1, 8, 1, 2, 3)] == [
        y.tolist() for (_, y), *_ in alone.epoch(5, 1, 8, 1, 2, 0)
    ][3:]
    evaluated = [i for r in range(2) for _, y in feed.shard(r, 2, 10) for i in y.tolist()]
    assert evaluated == list(range(96)) and pids(feed) == forked


def test_a_deterministic_runs_draws_are_the_same_at_any_worker_count_and_on_a_resume() -> None:
    def draws(workers: int, start: int) -> list[torch.Tensor]:
        feed = batches.Feed(Draws(), CPU, workers=workers, seeded=True)
        return [x for (x, _), *_ in feed.epoch(0, 1, 4, 0, 1, start)]

    whole = draws(1, 0)
    assert all(torch.equal(a, b) for a, b in zip(draws(2, 0), whole, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(draws(2, 3), whole[3:], strict=True))
    assert not torch.equal(whole[0], whole[1])


@pytest.mark.parametrize(
    ("sig", "state"), [(signal.SIGSTOP, "stopped (T)"), (signal.SIGKILL, "killed by signal")]
)
def test_a_worker_stopped_or_killed_is_named_within_the_ranks_bound(
    sig: signal.Signals, state: str
) -> None:
    """hang_timeout_s 4: the rank waits 2 s for a batch; a stopped worker is named then, a
    killed one at once (torch's own check); the message names the rank, the pass, the worker."""
    bound = functools.partial(allowances.loader_wait_s, 4)
    feed = batches.Feed(Items(), CPU, workers=2, wait_bound=bound).start()
    list(feed.epoch(5, 0, 8, 0, 1, 0))  # epoch 1 whole
    victim = pids(feed)[1]
    epoch2 = feed.epoch(5, 1, 8, 0, 1, 0)
    next(epoch2)
    os.kill(victim, sig)
    started = time.monotonic()
    try:
        with pytest.raises(loader.LoaderStalled) as raised:
            for _ in epoch2:
                pass
    finally:
        with contextlib.suppress(ProcessLookupError):  # (the rank ends its workers)
            os.kill(victim, signal.SIGCONT)
    named_after = time.monotonic() - started
    deadline = time.monotonic() + 5  # ended (SIGKILL), or the rank's exit would wait on it
    while loader._state(victim) not in ("Z", "X", "gone") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert loader._state(victim) in ("Z", "X", "gone")
    text = str(raised.value)
    assert text.startswith(f"rank 0, train epoch 2: DataLoader worker 1 (pid {victim}, "), text
    assert state in text, text
    assert named_after < 2.0 + loader.STACK_WAIT_S + 2, named_after
    print(f"(loader) a worker {sig.name}: named after {named_after:.1f} s: {text[:160]}")


def test_a_datasets_own_error_in_a_worker_is_raised_as_it_is() -> None:
    feed = batches.Feed(Items(broken=True), CPU, workers=1, wait_bound=lambda longest: 5.0)
    with pytest.raises(RuntimeError, match="a damaged image") as raised:
        list(feed.epoch(5, 0, 8, 0, 1, 0))
    assert not isinstance(raised.value, loader.LoaderStalled)


@pytest.mark.parametrize(
    ("setting", "longest", "expected"),
    [
        ("auto", None, 300.0),  # before any batch: half the first steps' allowance
        ("auto", 0.01, 30.0),  # quick batches: the floor
        ("auto", 12.0, 120.0),  # 10 times the longest wait seen
        (40, None, 20.0),  # a number: half of it, from the start
        (40, 12.0, 20.0),
    ],
)
def test_the_ranks_wait_for_a_batch_follows_what_it_measured(
    setting: float | str, longest: float | None, expected: float
) -> None:
    assert allowances.loader_wait_s(setting, longest) == expected


def test_the_bound_follows_the_longest_wait_of_the_slot() -> None:
    feed = batches.Feed(Items(), CPU, workers=1, wait_bound=functools.partial(
        allowances.loader_wait_s, "auto")).start()  # fmt: skip
    assert feed.source.loader._iterator._timeout == 300.0  # nothing measured yet
    list(feed.epoch(5, 0, 8, 0, 1, 0))
    longest = feed.source.longest_wait_s
    assert longest is not None and 0 < longest < 3.0
    assert feed.source.loader._iterator._timeout == 30.0


@pytest.mark.parametrize(
    "dataset",
    [
        TensorDataset(torch.arange(96.0)[:, None].expand(-1, 3), torch.arange(96)),
        Subset(
            TensorDataset(torch.arange(200.0)[:, None].expand(-1, 3), torch.arange(200)), range(96)
        ),
        Rows(),
        Rows(listed=True),
    ],
    ids=["TensorDataset", "Subset", "batch", "samples"],
)
def test_a_dataset_that_gives_batches_is_gathered_in_the_rank_in_the_same_order(
    dataset: Dataset,
) -> None:
    """A TensorDataset (or a Subset of one) and a dataset with ``__getitems__`` are gathered a
    batch at a time in the rank, however many workers were asked for (none forked, the
    dataset asked once a batch); each step's batch, its count and total are those the
    per-item path reads (Items(): the same samples), on a resume and at an epoch's uneven
    last batch (96 samples, global batch 10: 6 at the end, 3 a rank), and in evaluation."""
    feed, items = batches.Feed(dataset, CPU, workers=2), batches.Feed(Items(), CPU, workers=0)
    for start in (0, 4):
        got = list(feed.epoch(5, 1, 10, 1, 2, start))
        want = list(items.epoch(5, 1, 10, 1, 2, start))
        assert len(got) == len(want) == 10 - start
        for share, expected in zip(got, want, strict=True):
            assert torch.equal(share.batch[0], expected.batch[0])
            assert share.batch[1].tolist() == expected.batch[1].tolist()
            assert (share.count, share.total) == (expected.count, expected.total)
    evaluated = [i for r in range(2) for _, y in feed.shard(r, 2, 10) for i in y.tolist()]
    assert evaluated == list(range(96))
    assert feed._loader is None  # no workers forked
    if isinstance(dataset, Rows):
        assert dataset.asked == 10 + 6 + 10  # a request a batch: 2 passes and evaluation
