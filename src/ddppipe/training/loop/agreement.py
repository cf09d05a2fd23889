"""What the ranks agree on every few steps: whether to stop (a signal reached any of them),
whether to checkpoint now (rank 0's clock says a checkpoint is due by time:
:mod:`ddppipe.training.loop.save_clock`), and the first step whose loss was NaN or infinite on
any of them (the run then fails); and the epoch's loss sum.

Each step's batch-mean loss is copied into a window on the device (one copy a step, no host
read); a check folds the window on the device (the losses weighted by the samples that count
into the epoch's sum; the first non-finite step kept) and one small all-reduce (none at one
rank) carries the stop request, the signal, rank 0's save-due and the first non-finite step,
so every rank stops, saves, or fails at the same step. On a CPU (lag 0, below) the window is
the losses' values and the fold is arithmetic on them, written through the sum's and the
step's NumPy views: the copy and the fold's ten operators cost a short step (an MLP's 0.6 ms)
several per cent there.

On a GPU the ranks decide at a check on what the check before it exchanged
(:mod:`ddppipe.training.loop.host_reads`, lag 1): the host never waits for the GPU inside an
epoch. Before it saves or stops on that, it reads the first non-finite step of this check at
once, so no checkpoint holds weights a non-finite loss made. On a CPU, where a read costs
nothing, the ranks decide on the check's own exchange (lag 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ddppipe.runstate import failures, preemption
from ddppipe.training.loop import host_reads

ALL_FINITE = 2**62  # the first non-finite step's index when there was none
CHECK_EVERY = 10  # steps between two checks (the loop's, from an epoch's or a slot's start)


@dataclass(frozen=True)
class Agreed:
    """What the ranks agreed at a check."""

    stop: bool  # a stop signal reached a rank: checkpoint and stop
    save: bool  # rank 0's clock: a checkpoint is due by time


class Agreement:
    """One rank's side of the agreement, over a run of ``steps_per_epoch`` steps an epoch in a
    world of ``world_size`` ranks; its decisions ``lag`` checks late (None: its device's)."""

    def __init__(self, device: torch.device, steps_per_epoch: int, world_size: int,
                 lag: int | None = None) -> None:  # fmt: skip
        self.device, self.steps_per_epoch, self.world_size = device, steps_per_epoch, world_size
        self._reads: host_reads.HostReads[None] = host_reads.HostReads(
            host_reads.lag_for(device) if lag is None else lag
        )
        self._losses = torch.zeros(CHECK_EVERY, dtype=torch.float32, device=device)
        # (a CPU at lag 0: a read costs nothing) the window's values, folded on the host
        on_host = device.type == "cpu" and self._reads.lag == 0
        self._values: list[float] | None = [] if on_host else None
        self._counts: list[int] = []  # the samples that count of each step in the window
        self._start = 0  # the global index (0: the run's first step) of the window's first
        # This epoch's loss summed over the samples that counted (this slot's steps of it).
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        # The global index of the first non-finite loss.
        self._first_nonfinite = torch.full((), ALL_FINITE, dtype=torch.int64, device=device)
        if self._values is not None:  # (the same memory: the collectives reduce the tensors)
            self._sum_view, self._first_view = self.loss_sum.numpy(), self._first_nonfinite.numpy()
        self.signal = 0  # the stop signal any rank got, as the ranks agreed on it

    @property
    def lag(self) -> int:
        return self._reads.lag

    def start_epoch(self, step: int) -> None:
        """An epoch (or its rest) starts at global step ``step``: its loss sum from 0, and no
        decision of the last epoch's checks left to take."""
        self._counts, self._start = [], step
        if self._values is not None:
            self._values = []
        self.loss_sum.zero_()
        self._reads.drop()

    def note(self, loss: torch.Tensor, count: int) -> None:
        """The next step's batch-mean ``loss`` and the samples of it that count: on the
        device, no host read."""
        if len(self._counts) == len(self._losses):  # (more steps than a check's: fold first)
            self._fold()
        if self._values is not None:
            self._values.append(loss.item())
        else:
            self._losses[len(self._counts)].copy_(loss)
        self._counts.append(count)

    def _fold(self) -> None:
        """The window into the loss sum and the first non-finite step (on the device)."""
        n = len(self._counts)
        if n == 0:
            return
        if self._values is not None:
            self._fold_values()
            return
        losses = self._losses[:n]
        counts = host_reads.to_device(self._counts, torch.float64, self.device)
        self.loss_sum.add_(torch.dot(losses.double(), counts))
        bad = ~torch.isfinite(losses)
        at = torch.where(bad.any(), bad.int().argmax() + self._start, ALL_FINITE)
        torch.minimum(self._first_nonfinite, at, out=self._first_nonfinite)
        self._counts, self._start = [], self._start + n

    def _fold_values(self) -> None:
        """(A CPU) :meth:`_fold` of the window's values (a stand-in's non-finite loss, counted
        0, makes the sum NaN too: as on the device)."""
        values, counts = self._values, self._counts
        assert values is not None
        self._sum_view[()] += sum(v * c for v, c in zip(values, counts, strict=True))
        bad = next((i for i, v in enumerate(values) if not math.isfinite(v)), None)
        if bad is not None:
            self._first_view[()] = min(int(self._first_view), self._start + bad)
        self._values, self._counts, self._start = [], [], self._start + len(counts)

    def stop_requested(self, guard: preemption.Guard) -> bool:
        """Collective: whether any rank got the stop signal, decided now (an epoch's end)."""
        return self.check(guard, at_once=True).stop

    def check(self, guard: preemption.Guard, save_due: bool = False,
              at_once: bool = False) -> Agreed:  # fmt: skip
        """Collective: whether any rank got the stop signal, and whether to checkpoint
        (``save_due``: rank 0's; the others' is ignored); raise NonFiniteLoss when any rank's
        loss was non-finite (the earliest such step). ``lag`` checks late unless ``at_once``."""
        self._fold()
        due = int(save_due and dist.get_rank() == 0)
        flag = host_reads.to_device([int(guard.requested()), guard.received or 0, due],
                                    torch.int64, self.device)  # fmt: skip
        # MAX of the negated index: the earliest step
        flag = torch.cat([flag, (-self._first_nonfinite).view(1)])
        if self.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if at_once:
            self._reads.drop()
            values = flag.tolist()
        else:
            exchanged = self._reads.exchange(flag, None)
            if exchanged is None:  # (a lagging first check: nothing to decide yet)
                return Agreed(stop=False, save=False)
            values = exchanged[0]
        stop, signum, save, first = values
        if self.lag and not at_once and (stop or save):  # before a save: this check's too
            first = max(first, int(flag[3]))
        self._raise_if_nonfinite(-first)
        # The signal that stopped the run, on every rank: it may have reached only one of them.
        self.signal = signum
        return Agreed(stop=bool(stop), save=bool(save))

    def epoch_loss_sum(self) -> float:
        """Collective: the epoch's loss summed over every rank's samples that counted (this
        slot's steps of it); raise NonFiniteLoss when it is not finite (the earliest
        non-finite step of any rank)."""
        self._fold()
        if self.world_size > 1:
            dist.all_reduce(self.loss_sum)
        total = float(self.loss_sum)
        if not math.isfinite(total):  # every rank sees it: agree on the first
            if self.world_size > 1:
                dist.all_reduce(self._first_nonfinite, op=dist.ReduceOp.MIN)
            self._raise_if_nonfinite(int(self._first_nonfinite))
        return total

    def _raise_if_nonfinite(self, first: int) -> None:
        if first != ALL_FINITE:
            raise failures.NonFiniteLoss(first + 1, first // self.steps_per_epoch + 1)
