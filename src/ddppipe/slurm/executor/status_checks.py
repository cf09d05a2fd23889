"""Snakemake notices a training job's end within seconds, not at the SLURM plugin's next check.

snakemake-executor-plugin-slurm checks its jobs' states ``init_seconds_before_status_checks``
after a check that saw a job finish, then 10 s later each time, up to 180 s: a job's end is
noticed up to that interval late (33 s for a 1-epoch training, measured; up to 3 minutes for a
long one), and the rules after training wait for it. The plugin has no setting for this.

Every slot's launcher touches the run's ``state/slot-ended`` when it ends, whatever the outcome
(``ddppipe launch``; the state folder is on the filesystem the submitting machine shares with
the nodes). :func:`install` replaces the executor's sleep between checks: it sleeps as long as
the plugin asked, but looks at those files every second, and checks SLURM at once when a slot
ended during the sleep and every :data:`FAST_S` seconds for :data:`RECENT_S` seconds after
(the job's end: the step, the batch script, slurmctld recording the state). Otherwise SLURM is
queried exactly as the plugin would: reading a file costs the scheduler nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from ddppipe.runstate.state import StateDir

log = logging.getLogger(__name__)
TICK_S = 1.0  # how often the sleep looks at the slot-ended files
FAST_S = 2.0  # the interval between checks just after a slot ended
RECENT_S = 30.0  # how long after a slot's end checks come every FAST_S


def last_slot_end(states: Iterable[StateDir]) -> float:
    """The latest slot end (Unix time) recorded in any of ``states``; 0 if none."""
    latest = 0.0
    for folder in states:
        with contextlib.suppress(OSError):  # no slot ended there yet
            latest = max(latest, folder.slot_ended.stat().st_mtime)
    return latest


def interval(planned: float, now: float, last_end: float) -> float:
    """The sleep before the next check: ``planned`` (the plugin's), or :data:`FAST_S` while a
    slot's end is recent."""
    return min(planned, FAST_S) if now - last_end < RECENT_S else planned


async def sleep(planned: float, last_end: Callable[[], float]) -> None:
    """Sleep until the next status check: :func:`interval`, cut short when a slot ends."""
    start, seen = time.time(), last_end()
    deadline = start + interval(planned, start, seen)
    while (left := deadline - time.time()) > 0:
        await asyncio.sleep(min(TICK_S, left))
        if last_end() != seen:  # a change, not a comparison of the node's clock with ours
            return


def install(executor: type, states: list[StateDir]) -> bool:
    """Make ``executor`` (the SLURM plugin's class) wake on a slot's end; False, with a
    warning, when its interface is not the one this was written for (then nothing changes)."""
    if not asyncio.iscoroutinefunction(getattr(executor, "sleep", None)) or not isinstance(
        getattr(executor, "next_seconds_between_status_checks", None), property
    ):
        log.warning(
            "ddppipe: %s has no async sleep() and next_seconds_between_status_checks: "
            "Snakemake notices a training job's end at the plugin's next status check",
            executor.__name__,
        )
        return False

    async def woken_sleep(self: Any) -> None:
        await sleep(self.next_seconds_between_status_checks, lambda: last_slot_end(states))

    executor.sleep = woken_sleep
    return True
