"""The ranks' agreement every few steps (``ddppipe.training.loop.agreement``), as a table: a
sequence of steps' losses, a stop signal and a checkpoint due by time, to what each check
decides, at lag 0 (a CPU: the check's own exchange, the losses' values folded on the host)
and lag 1 (a GPU: the check before's, read without waiting for the device; the window folded
on the device), in a process group of this process alone."""

from __future__ import annotations

import math
import signal

import pytest
import torch

from ddppipe.runstate import failures, preemption
from ddppipe.training.loop import agreement

pytestmark = pytest.mark.usefixtures("one_rank")
CPU = torch.device("cpu")
NAN = math.nan


class Signals(preemption.Guard):
    """A guard that received SIGUSR1 at the check ``at`` (None: never); no handler installed."""

    def __init__(self, at: int | None) -> None:
        self.at, self.received, self.received_at, self.stop_at = at, None, None, None

    def requested(self) -> bool:
        return self.received is not None


def decisions(lag: int, nonfinite_at: int | None, signal_at: int | None,
              save_due_at: int | None, checks: int = 4) -> list[str]:  # fmt: skip
    """Checks after every 10 steps (losses 1.0, ``NAN`` at global step ``nonfinite_at``),
    the guard's signal arriving before check ``signal_at``, rank 0's clock due at check
    ``save_due_at`` (1 for the first); what each check decides, until one raises."""
    agreed, guard, out = agreement.Agreement(CPU, 100, 1, lag=lag), Signals(signal_at), []
    agreed.start_epoch(0)
    for check in range(1, checks + 1):
        for step in range((check - 1) * 10, check * 10):
            agreed.note(torch.tensor(NAN if step == nonfinite_at else 1.0), 2)
        if check == signal_at:
            guard.received = signal.SIGUSR1
        try:
            got = agreed.check(guard, save_due=check == save_due_at)
        except failures.NonFiniteLoss as e:
            return [*out, f"raise: {e}"]
        out.append("stop" if got.stop else "save" if got.save else "-")
    return out


RAISED = "raise: non-finite loss at step 13 (epoch 1)"


@pytest.mark.parametrize(
    ("lag", "nonfinite_at", "signal_at", "save_due_at", "expected"),
    [
        (0, None, None, None, ["-", "-", "-", "-"]),
        (1, None, None, None, ["-", "-", "-", "-"]),
        (0, 12, None, None, ["-", RAISED]),  # (step 13 is in the second check's window)
        (1, 12, None, None, ["-", "-", RAISED]),  # decided a check later
        (0, None, 2, None, ["-", "stop", "stop", "stop"]),
        (1, None, 2, None, ["-", "-", "stop", "stop"]),
        (0, None, None, 2, ["-", "save", "-", "-"]),
        (1, None, None, 2, ["-", "-", "save", "-"]),
        # lag 1, a save decided on the last check's exchange while this check's window had a
        # non-finite loss: that is read at once, and raised before anything is saved
        (1, 22, None, 2, ["-", "-", "raise: non-finite loss at step 23 (epoch 1)"]),
        (1, 22, 2, None, ["-", "-", "raise: non-finite loss at step 23 (epoch 1)"]),
    ],
)
def test_each_check_decides_on_its_exchange_or_the_one_before(
    lag: int, nonfinite_at: int | None, signal_at: int | None, save_due_at: int | None,
    expected: list[str],
) -> None:  # fmt: skip
    assert decisions(lag, nonfinite_at, signal_at, save_due_at) == expected


@pytest.mark.parametrize("lag", [0, 1])  # (0: the window's values folded on the host)
def test_a_stop_at_an_epochs_end_is_decided_at_once_and_the_loss_sum_counts_each_sample(
    lag: int,
) -> None:
    agreed = agreement.Agreement(CPU, 100, 1, lag=lag)
    agreed.start_epoch(40)  # (a slot resumed at step 40)
    for loss, count in [(1.0, 4), (2.0, 4), (3.5, 2), (9.0, 0)]:  # (the last: a stand-in)
        agreed.note(torch.tensor(loss), count)
    guard = Signals(None)
    guard.received = signal.SIGTERM
    assert agreed.stop_requested(guard) and agreed.signal == signal.SIGTERM
    assert agreed.epoch_loss_sum() == 4.0 + 8.0 + 7.0
    agreed.start_epoch(100)
    agreed.note(torch.tensor(1.0), 4)
    agreed.note(torch.tensor(math.inf), 0)  # a stand-in's infinite loss fails the run too
    with pytest.raises(failures.NonFiniteLoss, match="at step 102 \\(epoch 2\\)"):
        agreed.epoch_loss_sum()
