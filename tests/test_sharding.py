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
