"""What a slot's checkpoints cost, save by save: the seconds the training thread was blocked
(starting the save, which includes waiting for the previous one still being written, and the
next step's wait for the copy of its tensors), the copy's seconds and the write's. Their sums
and maxima are the slot's figures (:meth:`SaveCosts.figures`, in its attempt record); the
blocked seconds are the goodput's "checkpoint blocking" (:mod:`ddppipe.reports.goodput`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class SaveCosts:
    """One rank's checkpoint costs in the current slot (rank 0's are recorded)."""

    saves: int = 0
    timed: int = 0  # of them due by time (train.checkpoint_minutes)
    blocked_s: float = 0.0  # the training thread's, all saves
    blocked_max_s: float = 0.0  # the most one save blocked it
    queued: int = 0  # saves asked for while the previous one was still being written
    queued_s: float = 0.0  # their wait for it (a part of blocked_s)
    written: int = 0
    copy_s: float = 0.0  # into CPU memory (in the background where the strategy allows)
    copy_max_s: float = 0.0
    write_s: float = 0.0  # from the copy's end to the commit (in the background)
    write_max_s: float = 0.0
    _latest_s: float = 0.0  # the latest save's blocked seconds so far

    def started(self, blocked_s: float, timed: bool) -> None:
        """A save began, having blocked the training thread ``blocked_s``."""
        self.saves += 1
        self.timed += timed
        self._latest_s = 0.0
        self._blocked(blocked_s)

    def waited_for_previous(self, waited_s: float) -> None:
        """A save asked for while the previous one was in flight waited ``waited_s`` for it
        (counted in the blocked seconds that :meth:`started` is given)."""
        self.queued += 1
        self.queued_s += waited_s

    def gated(self, waited_s: float) -> None:
        """The step after the latest save waited ``waited_s`` for its copy."""
        self._blocked(waited_s)

    def committed(self, copy_s: float, write_s: float) -> None:
        """A save was committed: its copy took ``copy_s``, its write ``write_s``."""
        self.written += 1
        self.copy_s += copy_s
        self.copy_max_s = max(self.copy_max_s, copy_s)
        self.write_s += write_s
        self.write_max_s = max(self.write_max_s, write_s)

    def _blocked(self, seconds: float) -> None:
        self.blocked_s += seconds
        self._latest_s += seconds
        self.blocked_max_s = max(self.blocked_max_s, self._latest_s)

    def figures(self) -> dict[str, Any]:
        """The slot's figures (``checkpoint_s``: the training thread's blocked seconds)."""
        return {
            "checkpoints": self.saves,  # taken in this slot
            "timed_checkpoints": self.timed,  # of them by train.checkpoint_minutes
            "checkpoint_s": self.blocked_s,  # what they blocked the training thread
            "checkpoint_max_s": self.blocked_max_s,  # the most one of them blocked it
            "checkpoint_queued": self.queued,  # asked for while the previous one was written
            "checkpoint_queued_s": self.queued_s,  # (a part of checkpoint_s)
            "checkpoint_copy_s": self.copy_s,  # of the committed ones (rank 0's)
            "checkpoint_copy_max_s": self.copy_max_s,
            "checkpoint_write_s": self.write_s,
            "checkpoint_write_max_s": self.write_max_s,
        }
