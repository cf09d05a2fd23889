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

from ddppipe.core import atomic
from ddppipe.runstate.state import StateDir

# Exit status of a run that stopped early to be resumed (distinct from crashes).
EXIT_CODE = 75  # EX_TEMPFAIL
# The launcher's time-limit warning (slurm.stop_signal; USR1 unless set) and SLURM's SIGTERM.
STOP_SIGNAL_ENV = "DDPPIPE_STOP_SIGNAL"
# Unix time from which a stop is due even if no signal came (the job's end is near).
STOP_AT_ENV = "DDPPIPE_STOP_AT"
# Set by a packed sweep's allocation for its trials' launchers: "<warning> <end>", Unix times.
ALLOCATION_END_ENV = "DDPPIPE_ALLOCATION_END"


def allocation_warning(env: dict[str, str] | None = None) -> tuple[float | None, float | None]:
    """A packed trial's seconds to its allocation's time-limit warning and the allocation's
    end (Unix time), from :data:`ALLOCATION_END_ENV`; (None, None) without a time limit. The
    trial's launcher times the warning itself, as in a job of its own: a signal from the
    allocation could reach it before its handlers are set (a trial started just before)."""
    found = (os.environ if env is None else env).get(ALLOCATION_END_ENV, "").split()
    if len(found) != 2:
        return None, None
    warning, end = (float(t) for t in found)
    return max(0.0, warning - time.time()), end


def stop_signal(env: dict[str, str] | None = None) -> signal.Signals:
    """The time-limit warning's signal of this run (``slurm.stop_signal``, via the launcher)."""
    name = (os.environ if env is None else env).get(STOP_SIGNAL_ENV) or "SIGUSR1"
    return signal.Signals[name]


def signals() -> tuple[signal.Signals, ...]:
    return (stop_signal(), signal.SIGTERM)


# Set by the launcher for its training: which launcher's training wrote a note.
ATTEMPT_ENV = "DDPPIPE_ATTEMPT"
# Set by ``ddppipe agent`` for its workers: stop with exit 0, not 75 (see launch.run_agent).
UNDER_AGENT_ENV = "DDPPIPE_UNDER_AGENT"


class Guard:
    """Installs handlers for :func:`signals` and remembers the first one received.

    A stop is also due once :data:`STOP_AT_ENV`'s time has passed, when no signal arrives
    (a warning lost on its way, a scheduler that sends none).
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self.received_at: float | None = None  # time.monotonic() of the first signal
        stop_at = os.environ.get(STOP_AT_ENV)
        self.stop_at = float(stop_at) if stop_at else None
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
    note = {
        "signal": signal.Signals(signum).name if signum else None,
        "checkpoint": checkpoint,
        "attempt": os.environ.get(ATTEMPT_ENV),  # job id, host and pid of the launcher
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
