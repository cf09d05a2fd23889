"""An epoch's last global batch of any size at any world size (``sharding.local_share``,
``ddppipe.training.loop.stepping``): real gloo processes train each data path (tensors in
memory, a map-style dataset, a pack, shards; with and without DataLoader workers; DDP and
FSDP) through the training's own step, on dataset sizes that leave 1..W-1 samples (some
ranks none) or W+1 samples (slices of unequal sizes) in the last batch: every sample is
trained once, and the weights and the loss sum are one process's on the same global batches.

The same processes train a world smaller than the run's (``slurm.min_nodes``): 2 ranks each
standing for 2 of a run's 4 (:func:`ddppipe.data.sharding.micro_steps`), in 2 micro-steps a
step whose gradients accumulate (DDP's ``no_sync``, FSDP2's gradient sync off): each rank's
batch that of the run's world, the weights and the loss sum one process's again; and one
process in 2 micro-steps ends where 2 ranks do."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from ddppipe.data import batches, packed, shards
from ddppipe.training.loop import evaluate, stepping

SEED, EPOCHS = 5, 1
# (data path, strategy, DataLoader workers of a rank)
CASES = [("tensors", "ddp", 0), ("tensors", "fsdp", 0), ("map", "ddp", 2), ("map", "ddp", 0),
         ("packed", "ddp", 1), ("shards", "ddp", 2), ("shards", "ddp", 0)]  # fmt: skip
# world size -> dataset sizes at a global batch of 2 x world size: the last batch holds
# 1..W-1 samples (a rank or more without one), or W+1 (slices of 2 and 1)
SIZES = {2: [9, 11], 3: [13, 14, 16]}
# The smaller world's: 2 ranks of a run's 4, its data paths (in memory; read item by item, the
# DataLoader's sampler), on 9 samples: a last batch of 1, 3 of the 4 slices stand-ins
MICRO_CASES = [("tensors", "ddp", 0), ("tensors", "fsdp", 0), ("map", "ddp", 0)]
MICRO, MICRO_SIZE = 2, 9


def rows(n: int) -> torch.Tensor:
    """Sample i: 4 bytes, the first its id."""
    i = torch.arange(n)
    return torch.stack([i, 37 * i % 251, 91 * i % 253, 13 * i % 256], dim=1).to(torch.uint8)


def to_input(x: torch.Tensor) -> torch.Tensor:
    return x.float() / 255


def ids_of(inputs: torch.Tensor) -> list[int]:
    return (inputs[:, 0] * 255).round().long().tolist()


def decode(sample: shards.Sample) -> tuple[torch.Tensor, int]:
    return to_input(torch.frombuffer(bytearray(sample["x"]), dtype=torch.uint8)), int(sample["cls"])


def write(folder: Path, n: int) -> None:
    """Sample i's pack and shards (2 samples a shard) below ``folder``; its class i % 3."""
    x, labels = rows(n), [i % 3 for i in range(n)]
    packed.write(folder / f"pack-{n}", (4,), labels, lambda i: x[i].numpy())
    with shards.Writer(folder / f"shards-{n}", shard_bytes=5 * 1024) as writer:
        for i in range(n):
            writer.write({"x": x[i].numpy().tobytes(), "cls": str(labels[i]).encode()})


class Items(Dataset):
    """A dataset's samples, read one by one."""

    def __init__(self, samples: Dataset) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> Any:
        return self.samples[i]


def dataset(path: str, folder: Path, n: int) -> Any:
    labels = torch.arange(n) % 3
    if path == "tensors":
        return batches.Tensors(rows(n), labels, to_input)
    if path == "map":  # (read item by item: a TensorDataset is gathered as tensors are)
        return Items(TensorDataset(to_input(rows(n)), labels))
    if path == "packed":
        return packed.Packed(folder / f"pack-{n}", to_input)
    return shards.Sharded(folder / f"shards-{n}", decode, window=4)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def train(net: nn.Module, data: Any, workers: int, rank: int, world: int,
          batch: int, micro: int = 1) -> tuple[list[int], float]:  # fmt: skip
    """EPOCHS epochs of ``net`` on this rank's shares of global batches of ``batch`` through
    the training's step (``micro`` micro-steps a step); the ids of the samples that counted,
    and the sum of their losses."""
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.5)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    step = stepping.Stepper(net, optimizer, scheduler, evaluate.default_loss(), torch.float32,
                            torch.contiguous_format, world)  # fmt: skip
    feed, ids, loss = batches.Feed(data, torch.device("cpu"), workers), [], 0.0
    for epoch in range(EPOCHS):
        for share in feed.epoch(SEED, epoch, batch, rank, world, 0, micro):
            assert len(share.parts) == (micro if micro > 1 else 0)
            # each micro-step's batch at most a rank's of the run's world
            assert all(n <= -(-batch // (world * micro)) for n, _ in share.parts), share.parts
            loss += float(step(share)) * share.count
            ids += ids_of(share.batch[0])[: share.count]  # (stand-ins last)
    return ids, loss


def weights(net: nn.Module) -> dict[str, torch.Tensor]:
    net = getattr(net, "module", net)  # (DDP's wrapper)
    return {k: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for k, p in net.named_parameters()}  # fmt: skip


def rank_main(rank: int, folder: str) -> None:
    """One of 3 processes: every case at every size of 3 ranks, then (ranks 0 and 1 in a new
    group) of 2; what it trained into ``found-<world>-<rank>.pt``."""
    import multiprocessing

    import torch.distributed as dist

    from ddppipe.parallel import wrapping

    # A spawned process spawns its DataLoader workers too; a rank torchrun starts forks them.
    multiprocessing.set_start_method("fork", force=True)
    for world in [w for w in sorted(SIZES, reverse=True) if rank < w]:
        dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous-{world}",
                                rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))  # fmt: skip
        found = {}
        for n in SIZES[world]:
            for path, strategy, workers in CASES:
                net = wrapping.wrap(model(), torch.device("cpu"), strategy, 1, world)
                data = dataset(path, Path(folder), n)
                ids, loss = train(net, data, workers, rank, world, 2 * world)
                found[path, strategy, workers, n] = (ids, loss, weights(net))
                if (world, n) == (MICRO, MICRO_SIZE) and (path, strategy, workers) in MICRO_CASES:
                    net = wrapping.wrap(model(), torch.device("cpu"), strategy, 1, world)
                    ids, loss = train(net, data, workers, rank, world, world * MICRO, MICRO)
                    found[path, strategy, workers, n, "micro"] = (ids, loss, weights(net))
        torch.save(found, f"{folder}/found-{world}-{rank}.pt")
        dist.destroy_process_group()


Found = dict[int, list[dict[tuple[Any, ...], tuple[list[int], float, dict[str, torch.Tensor]]]]]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Found]:
    """The 3 processes' training (:func:`rank_main`): the data's folder, and by world size
    each rank's (samples, loss sum, weights) of each case."""
    import torch.multiprocessing as mp

    folder = tmp_path_factory.mktemp("last-batch")
    for n in {n for sizes in SIZES.values() for n in sizes}:
        write(folder, n)
    mp.spawn(rank_main, args=(str(folder),), nprocs=max(SIZES))
    return folder, {world: [torch.load(folder / f"found-{world}-{r}.pt", weights_only=False)
                            for r in range(world)] for world in SIZES}  # fmt: skip


def check(ranks: list[tuple[list[int], float, dict[str, torch.Tensor]]], n: int,
          loss_sum: float, expected: dict[str, torch.Tensor], what: str) -> None:  # fmt: skip
    """Every sample of ``n`` trained once an epoch by ``ranks``, their loss sum ``loss_sum``
    and every rank's weights ``expected``."""
    ids = [i for ids, _, _ in ranks for i in ids]
    assert sorted(ids) == sorted(list(range(n)) * EPOCHS), what
    assert sum(loss for _, loss, _ in ranks) == pytest.approx(loss_sum, rel=1e-5), what
    for _, _, found in ranks:
        assert found.keys() == expected.keys()
        for key, value in expected.items():
            torch.testing.assert_close(found[key], value, rtol=1e-5, atol=1e-6,
                                       msg=f"{what}: {key}")  # fmt: skip


def test_a_last_batch_of_any_size_trains_each_sample_once_as_one_process(
    trained: tuple[Path, Found],
) -> None:
    folder, found = trained
    for world, sizes in SIZES.items():
        for n, case in [(n, case) for n in sizes for case in CASES]:
            # one process on the same global batches (the path's own order: the shards')
            alone = model()
            _, alone_loss = train(alone, dataset(case[0], folder, n), 0, 0, 1, 2 * world)
            check([f[(*case, n)] for f in found[world]], n, alone_loss, weights(alone),
                  f"{world} ranks, {case}, n={n}")  # fmt: skip


def test_a_smaller_world_keeps_each_ranks_batch_and_trains_as_the_runs(
    trained: tuple[Path, Found],
) -> None:
    """2 ranks standing for a run's 4 (micro-steps of a sample each, the run's ranks'), stand-ins
    in the last batches included, train as one process on the same global batches; and one
    process in 2 micro-steps trains as the 2 ranks of the run above (each a batch of 2)."""
    folder, found = trained
    for case in MICRO_CASES:
        n = MICRO_SIZE
        alone = model()
        _, alone_loss = train(alone, dataset(case[0], folder, n), 0, 0, 1, MICRO * MICRO)
        ranks = [f[(*case, n, "micro")] for f in found[MICRO]]
        check(ranks, n, alone_loss, weights(alone), f"2 ranks of 4, {case}, n={n}")
        one = model()
        _, one_loss = train(one, dataset(case[0], folder, n), 0, 0, 1, 2 * MICRO, MICRO)
        check([f[(*case, n)] for f in found[MICRO]], n, one_loss, weights(one),
              f"1 rank of 2, {case}, n={n}")  # fmt: skip
