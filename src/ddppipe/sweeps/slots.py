"""A model-based sweep's free slots: a round waits for one before it asks for its trial.

Round k (k >= 1) is suggested when ``k`` of the trials before it (``max_parallel + k - 1``)
have ended, whichever they are: the slot the first of them frees is taken at once, not the
slot of one trial fixed in advance. Its Snakemake job starts once round k - 1 is written and
waits here, looking at the trials' files every :data:`POLL_S` seconds; no training, no
scheduler is asked.

A trial's training has ended when its attempt history (the train rule's output) is written,
or when no launcher holds its state folder's lock (:func:`ddppipe.runstate.state_lock.held`:
the kernel frees it however the launcher ends) and its last slot did not stop to go on in a
next one (exit status 75: a time limit, a preemption, a packed trial waiting for its next
allocation). A failed trial frees its slot: with ``--keep-going`` the sweep goes on with the
others; without, Snakemake starts no new job and the round ends at once. A trial whose
training has not started yet holds its slot (Snakemake starts it next).

Suggesting early is safe (Snakemake's ``ddppipe_sweep_trials`` resource still caps the
trainings at ``max_parallel``), waiting forever is not: when no training of the sweep has held
its lock for :data:`IDLE_S` seconds, the round is suggested anyway.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from ddppipe.runstate import attempts, preemption, state_lock, sweep_rounds
from ddppipe.runstate.state import StateDir
from ddppipe.settings import layout as run_layout
from ddppipe.settings import sweep as sweeps

log = logging.getLogger(__name__)
POLL_S = 0.2  # how often a waiting round looks at the trials' files
IDLE_S = 120.0  # no training running for this long: suggest without waiting longer


ENDED, TRAINING, WAITING = "ended", "training", "waiting"


def training_state(run: str, results: Path = run_layout.RESULTS) -> str:
    """Where the training of ``run`` stands: :data:`ENDED` for good (completed, pruned or
    failed), :data:`TRAINING` (a launcher holds its lock) or :data:`WAITING` (not started
    yet, or stopped to go on in a next slot)."""
    layout = run_layout.RunLayout(run, results)
    if layout.train.attempts.is_file():
        return ENDED  # the train rule's output: written when its training completed
    state = StateDir(layout.state)
    if not state.lock.exists():
        return WAITING  # no launcher has started: its job is about to
    if state_lock.held(state):
        return TRAINING
    history = attempts.read(state.attempts)
    if not history:
        return ENDED  # its launcher ended before training (a preflight, a refused retry)
    last = history[-1]
    return ENDED if last.end is None or last.exit_status != preemption.EXIT_CODE else WAITING


def training_ended(run: str, results: Path = run_layout.RESULTS) -> bool:
    """Whether the training of ``run`` has ended for good (completed, pruned or failed)."""
    return training_state(run, results) == ENDED


@dataclass(frozen=True)
class Freed:
    """What a waiting round saw: the trials ended before it asked, how long it waited."""

    ended: list[str]  # the trials' names, in the order they were seen to end
    waited_s: float
    idle: bool = False  # suggested after IDLE_S without any training running

    def words(self) -> str:
        if self.idle:
            return f"no training ran for {IDLE_S:.0f} s: suggesting without a free slot"
        last = self.ended[-1] if self.ended else "none"
        return f"a slot freed ({last} ended) after {self.waited_s:.1f} s"


def wait(
    sweep: sweeps.Sweep,
    k: int,
    rounds: Path | None = None,
    results: Path = run_layout.RESULTS,
    poll_s: float = POLL_S,
    idle_s: float = IDLE_S,
) -> Freed:
    """Wait until round ``k`` has a free slot: ``k`` of the trials before it ended."""
    before = sweep_rounds.trials(sweep, upto=k, rounds=rounds)
    need = sweep_rounds.ended_before(sweep, k, rounds)
    start = time.monotonic()
    ended: list[str] = []
    idle_since: float | None = None
    told = False
    while True:
        states = {t.name: training_state(t.run, results) for t in before if t.name not in ended}
        ended += [name for name, found in states.items() if found == ENDED]
        now = time.monotonic()
        if len(ended) >= need:
            return Freed(ended, now - start)
        if TRAINING in states.values():
            idle_since = None
        elif idle_since is None:
            idle_since = now
        elif now - idle_since >= idle_s:
            return Freed(ended, now - start, idle=True)
        if not told:
            log.info("round %d waits for a free slot: %d of the %d trials before it ended, "
                     "%d must", k, len(ended), len(before), need)  # fmt: skip
            told = True
        time.sleep(poll_s)
