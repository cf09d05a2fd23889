"""Catch the signals a scheduler sends before it stops a job, so training can checkpoint.

SLURM sends ``--signal`` (e.g. USR1 some seconds before the time limit) and SIGTERM on
preemption or ``scancel``. The handler only records the signal; the training loop asks
:meth:`Guard.requested` at step boundaries, checkpoints and exits with :data:`EXIT_CODE`.
"""

from __future__ import annotations

import signal
from types import FrameType

# Exit status of a run that stopped early to be resumed (distinct from crashes).
EXIT_CODE = 75  # EX_TEMPFAIL
SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class Guard:
    """Installs handlers for :data:`SIGNALS` and remembers the first one received."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous = {}
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum

    def requested(self) -> bool:
        return self.received is not None

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class Preempted(Exception):
    """Training stopped early on a signal after writing a checkpoint."""

    def __init__(self, signum: int, checkpoint: str) -> None:
        super().__init__(
            f"stopped on {signal.Signals(signum).name} after writing {checkpoint}; "
            "run again to resume"
        )
        self.signum = signum
        self.checkpoint = checkpoint
