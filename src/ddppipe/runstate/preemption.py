"""Catch the signals a scheduler sends before it stops a job, so training can checkpoint.

The launcher sends USR1 some seconds before a SLURM job's time limit, SLURM SIGTERM on
preemption or ``scancel``. The handler only records the signal; the training loop asks
:meth:`Guard.requested` at step boundaries, checkpoints, leaves a :func:`record` note in
the state folder and exits. The launcher turns that note into :data:`EXIT_CODE`, whatever
exit status srun or torchrun made of the ranks' exits (srun reports a task it killed
after another node's agent exited first as 143).
"""

from __future__ import annotations

import json
import os
import signal
import time
from types import FrameType

from ddppipe.core import atomic, env_names, slot
from ddppipe.runstate.state import StateDir

# Exit status of a run that stopped early to be resumed (distinct from crashes).
EXIT_CODE = 75  # EX_TEMPFAIL


def allocation_warning(env: dict[str, str] | None = None) -> tuple[float | None, float | None]:
    """A packed trial's seconds to its allocation's time-limit warning and the allocation's
    end (Unix time), from :data:`ddppipe.core.env_names.ALLOCATION_END`; (None, None) without
    a time limit. The trial's launcher times the warning itself, as in a job of its own: a
    signal from the allocation could reach it before its handlers are set (a trial started
    just before)."""
    found = (os.environ if env is None else env).get(env_names.ALLOCATION_END, "").split()
    if len(found) != 2:
        return None, None
    warning, end = (float(t) for t in found)
    return max(0.0, warning - time.time()), end


def stop_signal() -> signal.Signals:
    """The time-limit warning's signal of this slot (``slurm.stop_signal``, its record's)."""
    found = slot.read()
    return signal.Signals[found.stop_signal if found else "SIGUSR1"]


def signals() -> tuple[signal.Signals, ...]:
    return (stop_signal(), signal.SIGTERM)


class Guard:
    """Installs handlers for :func:`signals` and remembers the first one received.

    A stop is also due once the slot record's ``stop_at`` has passed, when no signal arrives
    (a warning lost on its way, a scheduler that sends none).
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self.received_at: float | None = None  # time.monotonic() of the first signal
        found = slot.read()
        self.stop_at = found.stop_at if found else None
        self._previous = {}
        for sig in signals():
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received, self.received_at = signum, time.monotonic()

    def requested(self) -> bool:
        if self.received is None and self.stop_at is not None and time.time() >= self.stop_at:
            self.received, self.received_at = stop_signal(), time.monotonic()
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


def record(state: StateDir, signum: int, checkpoint: str) -> None:
    """Note in ``state`` that training stopped on ``signum`` after writing ``checkpoint``."""
    found = slot.read()
    note = {
        "signal": signal.Signals(signum).name if signum else None,
        "checkpoint": checkpoint,
        "attempt": found.launcher if found else None,  # job id, host and pid of the launcher
    }
    note["time"] = time.time()
    atomic.write_text(state.stop_note, json.dumps(note) + "\n")


def take(state: StateDir) -> dict | None:
    """The note of the run that just ended, removed so the next run starts without one."""
    path = state.stop_note
    try:
        note = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    path.unlink(missing_ok=True)
    return note
