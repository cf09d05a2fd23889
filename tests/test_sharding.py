import pytest
import torch

from ddppipe.data import sharding


@pytest.mark.parametrize(
    ("n", "batch", "world"), [(1000, 64, 2), (1000, 64, 4), (97, 10, 3), (5, 4, 4)]
)
def test_every_sample_once_and_disjoint(n: int, batch: int, world: int) -> None:
    shards = [torch.cat(sharding.shard(n, 7, 3, batch, r, world)) for r in range(world)]
    union = torch.cat(shards)
    assert union.numel() == n
    assert torch.equal(union.sort().values, torch.arange(n))


def test_deterministic_from_seed_and_epoch() -> None:
    a = sharding.shard(500, 1, 0, 32, 1, 2)
    b = sharding.shard(500, 1, 0, 32, 1, 2)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not torch.equal(torch.cat(a), torch.cat(sharding.shard(500, 1, 1, 32, 1, 2)))
    assert not torch.equal(torch.cat(a), torch.cat(sharding.shard(500, 2, 0, 32, 1, 2)))


def test_global_batch_does_not_depend_on_world_size() -> None:
    for step in range(sharding.steps_per_epoch(300, 64)):
        one = sharding.shard(300, 5, 2, 64, 0, 1)[step]
        four = torch.cat([sharding.shard(300, 5, 2, 64, r, 4)[step] for r in range(4)])
        assert torch.equal(one, four)


def test_eval_range_covers_the_set() -> None:
    ranges = [sharding.eval_range(10, r, 3) for r in range(3)]
    assert ranges == [(0, 4), (4, 7), (7, 10)]
    assert sharding.eval_range(1, 1, 2) == (0, 0)


def test_loader_workers_are_chosen_for_the_tasks_data() -> None:
    """Tensors in memory load nothing: no worker. A dataset read item by item (files) gets
    the CPUs beside the compute threads, and at least one worker where the threads take the
    process's whole share (it had none: files decoded in the training's thread). A set
    launch.loader_workers wins."""
    from torch.utils.data import TensorDataset

    from ddppipe.data import batches

    tensors = batches.Tensors(torch.zeros(4, 2), torch.zeros(4))
    files = TensorDataset(torch.zeros(4, 2))  # (read item by item, as a folder of files is)
    assert batches.loader_workers(None, tensors, 16, 2, 2) == 0
    assert batches.loader_workers(None, TensorDataset(torch.zeros(4, 2), torch.zeros(4)),
                                  16, 2, 2) == 0  # fmt: skip
    assert batches.loader_workers(None, files, 16, 2, 2) == 6  # 8 CPUs each, 2 compute
    assert batches.loader_workers(None, files, 4, 2, 2) == 1  # threads take the share
    assert batches.loader_workers(3, tensors, 4, 2, 2) == 3
    assert batches.loader_workers(0, files, 16, 2, 2) == 0


def test_a_rank_a_last_batch_has_no_sample_for_runs_a_stand_in_counted_zero() -> None:
    """A last batch of 2 samples at 3 ranks: ranks 0 and 1 one each, rank 2 the batch's first
    sample again, counted 0 (it joins the step, trains nothing); a batch of 4 splits 2/1/1."""
    last = torch.tensor([41, 17])
    shares = [sharding.local_share(last, r, 3) for r in range(3)]
    assert [(part.tolist(), count) for part, count in shares] == [([41], 1), ([17], 1), ([41], 0)]
    shares = [sharding.local_share(torch.tensor([5, 6, 7, 8]), r, 3) for r in range(3)]
    assert [(part.tolist(), count) for part, count in shares] == [([5, 6], 2), ([7], 1), ([8], 1)]


def test_each_ranks_loss_is_weighted_by_its_share_of_the_global_batch() -> None:
    """Slices of 2, 1 and 1 samples of a batch of 4 at 3 ranks; a stand-in weighs nothing."""
    from ddppipe.training.loop import stepping

    assert [stepping.loss_weight(c, 4, 3) for c in (2, 1, 1)] == [1.5, 0.75, 0.75]
    assert stepping.loss_weight(0, 2, 3) == 0.0
    assert stepping.loss_weight(16, 32, 2) == 1.0  # even slices: the plain mean


@pytest.mark.parametrize(("configured", "world", "micro"), [
    (2, 2, 1), (2, 4, 1),  # the run's world, or a larger one: one step
    (2, 1, 2), (4, 2, 2), (8, 2, 4),  # half, a quarter: each rank stands for 2, 4
    (3, 2, 2), (4, 3, 2), (8, 3, 3),  # not dividing: enough that no rank's batch grows
])  # fmt: skip
def test_a_smaller_world_takes_micro_steps_enough_to_keep_each_ranks_batch(
    configured: int, world: int, micro: int
) -> None:
    assert sharding.micro_steps(configured, world) == micro


@pytest.mark.parametrize(("n", "rank", "world", "micro", "indices", "count", "parts"), [
    (8, 0, 1, 2, [0, 1, 2, 3, 4, 5, 6, 7], 8, ((4, 4), (4, 4))),  # 1 rank of 2
    (8, 1, 2, 2, [4, 5, 6, 7], 4, ((2, 2), (2, 2))),  # rank 1 of 2 stands for 2 and 3 of 4
    (7, 1, 2, 2, [4, 5, 6], 3, ((2, 2), (1, 1))),  # slices of 2, 2, 2, 1 as 4 ranks have
    (3, 1, 2, 2, [2, 0], 1, ((1, 1), (1, 0))),  # the 4th's stand-in: a sample counted 0
    (3, 0, 2, 1, [0, 1], 2, ()),  # the run's world: one step, as local_share
])  # fmt: skip
def test_a_ranks_micro_steps_are_the_slices_of_the_ranks_it_stands_for(
    n: int, rank: int, world: int, micro: int, indices: list[int], count: int,
    parts: tuple[tuple[int, int], ...],
) -> None:  # fmt: skip
    found, counted, split = sharding.rank_share(torch.arange(n), rank, world, micro)
    assert (found.tolist(), counted, split) == (indices, count, parts)


def test_a_smaller_world_says_what_it_does_to_keep_each_ranks_batch() -> None:
    assert sharding.micro_note(4, 4, 64) is None
    assert sharding.micro_note(4, 2, 64) == (
        "2 rank(s) of the run's 4: each trains 2 micro-steps a step of up to 16 samples, "
        "gradients accumulated: each rank's batch as in the run's world (up to 16), the global "
        "batch (64) kept"
    )
    assert sharding.micro_note(3, 2, 96) == (
        "2 rank(s) of the run's 3: each trains 2 micro-steps a step of up to 24 samples, "
        "gradients accumulated: each rank's batch as in the run's world (up to 32), the global "
        "batch (96) kept; 3 ranks do not divide among 2, so the global batch splits into 4 "
        "slices, not 3: a model with batch statistics (BatchNorm) sees other batches than in "
        "the run's world"
    )
