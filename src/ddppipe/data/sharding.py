"""Per-epoch data order, sharded across ranks like DistributedSampler but without padding.

Each epoch draws one permutation from (seed, epoch). Step k's global batch is
``perm[k*B:(k+1)*B]`` whatever the world size; each rank takes one contiguous slice of it.
So every sample is seen exactly once per epoch, ranks are disjoint, and the global batch
composition does not depend on how many ranks share it.

An epoch's last batch may hold fewer samples than there are ranks: a rank left without one
still takes part in the step (its collectives) with a stand-in, counted as no sample
(:func:`local_share`).

A world smaller than the run's (fewer nodes after a lost one, ``slurm.min_nodes``) keeps each
rank's batch and the global batch: each rank stands for :func:`micro_steps` ranks of the run's
world and trains their slices one after the other, accumulating their gradients
(:func:`rank_share`); the step's update is the global batch's mean as before.
"""

from __future__ import annotations

import torch


def epoch_permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    """A permutation of range(n) determined by seed and epoch only."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=generator)


def steps_per_epoch(n: int, global_batch: int) -> int:
    return -(-n // global_batch)


def global_batch(perm: torch.Tensor, step: int, global_batch_size: int) -> torch.Tensor:
    return perm[step * global_batch_size : (step + 1) * global_batch_size]


def local_slice(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank's contiguous share of a global batch (sizes differ by at most one)."""
    return torch.tensor_split(batch, world_size)[rank]


def local_share(batch: torch.Tensor, rank: int, world_size: int) -> tuple[torch.Tensor, int]:
    """Rank's share of a global batch to run, and how many of its samples count: its slice
    (:func:`local_slice`), all counted; or, where the batch has fewer samples than there are
    ranks and none is left for this rank, a stand-in counted 0: the batch's first sample, so
    the rank still runs the step's forward and backward (the collectives every rank must
    join) without training anything."""
    if world_size == 1:
        return batch, batch.numel()
    part = local_slice(batch, rank, world_size)
    if part.numel() == 0 and batch.numel() > 0:
        return batch[:1], 0
    return part, part.numel()


def micro_steps(configured: int, world_size: int) -> int:
    """How many ranks of the run's ``configured`` world (``launch.nnodes`` x
    ``launch.nproc_per_node``) each of ``world_size`` ranks stands for, one micro-step each, so
    that no rank's batch grows: 1 in the configured world (or a larger one)."""
    return max(1, -(-configured // world_size))


def micro_note(configured: int, world_size: int, batch_size: int) -> str | None:
    """What a world of ``world_size`` ranks, the run's being ``configured``, does to keep each
    rank's batch of the global ``batch_size`` (None: nothing, it is the run's world)."""
    micro = micro_steps(configured, world_size)
    if micro == 1:
        return None
    slices = micro * world_size
    said = (f"{world_size} rank(s) of the run's {configured}: each trains {micro} micro-steps a "
            f"step of up to {-(-batch_size // slices)} samples, gradients accumulated: each "
            f"rank's batch as in the run's world (up to {-(-batch_size // configured)}), the "
            f"global batch ({batch_size}) kept")  # fmt: skip
    if slices == configured:
        return said
    return (
        f"{said}; {configured} ranks do not divide among {world_size}, so the global batch "
        f"splits into {slices} slices, not {configured}: a model with batch statistics "
        "(BatchNorm) sees other batches than in the run's world"
    )


def rank_share(
    batch: torch.Tensor, rank: int, world_size: int, micro: int = 1
) -> tuple[torch.Tensor, int, tuple[tuple[int, int], ...]]:
    """Rank's share of a global batch in ``micro`` micro-steps (:func:`micro_steps`): the
    slices (:func:`local_share`) of ranks ``rank * micro`` to ``rank * micro + micro - 1`` of a
    world of ``world_size * micro``, joined; how many of its samples count; each micro-step's
    (samples, of them counted), in order (() for one step: its share as :func:`local_share`)."""
    if micro == 1:
        local, count = local_share(batch, rank, world_size)
        return local, count, ()
    parts = [local_share(batch, rank * micro + j, world_size * micro) for j in range(micro)]
    joined = torch.cat([part for part, _ in parts])
    return joined, sum(c for _, c in parts), tuple((part.numel(), c) for part, c in parts)


def shard(
    n: int, seed: int, epoch: int, batch_size: int, rank: int, world_size: int
) -> list[torch.Tensor]:
    """All of one rank's index batches for one epoch."""
    perm = epoch_permutation(n, seed, epoch)
    return [
        local_slice(global_batch(perm, k, batch_size), rank, world_size)
        for k in range(steps_per_epoch(n, batch_size))
    ]


def eval_range(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, stop) of rank's contiguous share of an evaluation set."""
    bounds = torch.tensor_split(torch.arange(n), world_size)[rank]
    if bounds.numel() == 0:
        return 0, 0
    return int(bounds[0]), int(bounds[-1]) + 1
