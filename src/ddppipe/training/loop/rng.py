"""A rank's random streams (its dropout): saved in checkpoints, restored or reseeded on resume."""

from __future__ import annotations

import torch


def rank_seed(seed: int, epoch: int, rank: int) -> int:
    """Seed of a rank's dropout stream when no saved RNG state fits."""
    return (seed * 1_000_003 + epoch) * 4099 + rank + 1


def state(device: torch.device) -> dict[str, torch.Tensor]:
    """This process's RNG state: the CPU's, and ``device``'s on a GPU."""
    saved = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        saved["cuda"] = torch.cuda.get_rng_state(device)
    return saved


def restore(saved: dict[str, torch.Tensor], device: torch.device) -> None:
    """Set the RNG state :func:`state` returned (its GPU part only on a GPU)."""
    torch.set_rng_state(saved["cpu"])
    if "cuda" in saved and device.type == "cuda":
        torch.cuda.set_rng_state(saved["cuda"], device)
