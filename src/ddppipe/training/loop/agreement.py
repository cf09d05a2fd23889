"""What the ranks agree on every few steps: whether to stop (a signal reached any of them),
whether to checkpoint now (rank 0's clock says a checkpoint is due by time:
:mod:`ddppipe.training.loop.save_clock`), and the first step whose loss was NaN or infinite on
any of them (the run then fails).

Each rank notes its first non-finite step in a device-side flag (no host sync a step); one tiny
all-reduce at each check carries all three, so every rank stops, saves, or fails, at the same
step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ddppipe.runstate import failures, preemption

ALL_FINITE = 2**62  # the first non-finite step's index when there was none


@dataclass(frozen=True)
class Agreed:
    """What the ranks agreed at a check."""

    stop: bool  # a stop signal reached a rank: checkpoint and stop
    save: bool  # rank 0's clock: a checkpoint is due by time


class Agreement:
    """One rank's side of the agreement, over a run of ``steps_per_epoch`` steps an epoch."""

    def __init__(self, device: torch.device, steps_per_epoch: int) -> None:
        self.steps_per_epoch = steps_per_epoch
        # The global index (0: the run's first step) of the first non-finite loss.
        self._first_nonfinite = torch.full((), ALL_FINITE, dtype=torch.int64, device=device)
        self.signal = 0  # the stop signal any rank got, as the ranks agreed on it

    def note(self, step: int, loss: torch.Tensor) -> None:
        """Note global step ``step`` as the first non-finite one if its loss is (and none was
        before): on the device, no sync."""
        at = torch.where(torch.isfinite(loss), ALL_FINITE, step)
        torch.minimum(self._first_nonfinite, at, out=self._first_nonfinite)

    def stop_requested(self, guard: preemption.Guard) -> bool:
        """Collective: whether any rank got the stop signal (:meth:`check`)."""
        return self.check(guard).stop

    def check(self, guard: preemption.Guard, save_due: bool = False) -> Agreed:
        """Collective: whether any rank got the stop signal, and whether to checkpoint
        (``save_due``: rank 0's; the others' is ignored); raise NonFiniteLoss when any rank's
        loss was non-finite since the last check (the earliest such step)."""
        due = int(save_due and dist.get_rank() == 0)
        flag = torch.tensor([int(guard.requested()), 0, guard.received or 0, due],
                            device=self._first_nonfinite.device)  # fmt: skip
        flag[1] = -self._first_nonfinite  # MAX of the negated index: the earliest step
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        stop, first, signum, save = flag.tolist()
        self._raise_if_nonfinite(-first)
        # The signal that stopped the run, on every rank: it may have reached only one of them.
        self.signal = signum
        return Agreed(stop=bool(stop), save=bool(save))

    def nonfinite_epoch(self) -> None:
        """Collective, when every rank saw a non-finite epoch loss: raise NonFiniteLoss at the
        earliest non-finite step of any rank."""
        dist.all_reduce(self._first_nonfinite, op=dist.ReduceOp.MIN)
        self._raise_if_nonfinite(int(self._first_nonfinite))

    def _raise_if_nonfinite(self, first: int) -> None:
        if first != ALL_FINITE:
            raise failures.NonFiniteLoss(first + 1, first // self.steps_per_epoch + 1)
