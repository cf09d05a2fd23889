"""The one line ``ddppipe reproduce`` ends with: ``identical``, or where the reproduction first
differs from the run and why, when the records tell."""

from __future__ import annotations

from ddppipe.reproduce.compare import Comparison, EpochDiff

UNKNOWN = "unknown (same config, code, data, software and device as far as recorded)"


def _value(value: float | None) -> str:
    return "none" if value is None else f"{value:.6g}"


def _where(diff: EpochDiff, steps_per_epoch: int | None) -> str:
    name = "loss" if diff.key == "train_loss" else diff.key
    step = f", step {diff.epoch * steps_per_epoch}" if steps_per_epoch else ""
    return (f"differs from epoch {diff.epoch}{step}: {name} {_value(diff.run)} vs "
            f"{_value(diff.again)}")  # fmt: skip


def line(found: Comparison, causes: list[str], steps_per_epoch: int | None) -> str:
    """``identical``, or ``differs from epoch E, step S: loss A vs B; cause: ...`` (S: the
    global step at the end of epoch E, where the runs' numbers are first compared)."""
    if found.identical:
        return "identical"
    if found.epoch is not None:
        where = _where(found.epoch, steps_per_epoch)
    elif found.tensors:
        worst = max(found.tensors, key=lambda t: t.largest)
        where = (f"differs in the final weights only: {len(found.tensors)} tensors, largest "
                 f"difference {worst.largest:.3g} in {worst.name}")  # fmt: skip
    else:
        where = f"differs in the final evaluation only: {', '.join(found.evaluation)}"
    return f"{where}; cause: {'; '.join(causes) if causes else UNKNOWN}"
