"""When a checkpoint is due by time (``train.checkpoint_minutes``): rank 0's wall clock since
the last checkpoint the training took (or since this slot's training began).

Only rank 0 asks :meth:`SaveClock.due`; the ranks' clocks differ, so its answer travels in the
ranks' every-few-steps agreement (:mod:`ddppipe.training.loop.agreement`) and every rank saves
at the same step.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class SaveClock:
    """Minutes since the last checkpoint against ``minutes`` (None: never due)."""

    def __init__(self, minutes: float | None, now: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = None if minutes is None else minutes * 60.0
        self._now = now
        self._last = now()

    def due(self) -> bool:
        """Whether the interval has passed since the last checkpoint."""
        return self.interval_s is not None and self._now() - self._last >= self.interval_s

    def restart(self) -> None:
        """A checkpoint was taken now (by time, at an epoch's end, or at training's start)."""
        self._last = self._now()
