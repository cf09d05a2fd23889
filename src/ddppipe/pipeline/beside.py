"""Rules beside a training start while it holds every core: Snakemake's local scheduler, extended.

ddppipe gives the rules that run beside a training no core (``threads: 0``: a finished
trial's evaluation, plots, export and summary, the next trial's config, a ``tpe`` round
waiting for a free slot). Snakemake's scheduler selects no job at all while no core is free
(``JobScheduler.job_selector`` returns nothing when ``_cores`` is 0), so with the training
holding every core they waited for its end: a sweep's rules of one trial ran at the next
trial's end, piled up to the sweep's end (measured: 16 of the 40 beside jobs of an 8-trial
sweep ran after the last training), and a round could not start waiting for its slot.

:func:`install` wraps the selector: while no core is free it offers Snakemake's own selector
the ready jobs that need none, with one core lent for the call and taken back after (a
zero-core job uses none of it). Their other resources (``ddppipe_beside``, the sweep's
slots) are checked as always. Otherwise nothing changes. On a scheduler of another shape
it warns and changes nothing.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger(__name__)
CORES = "_cores"  # Snakemake's name of the --cores resource


def _needs_no_core(job: Any) -> bool:
    return job.scheduler_resources.get(CORES, 0) == 0


def install(scheduler: type) -> bool:
    """Wrap ``scheduler.job_selector`` (Snakemake's JobScheduler); False, with a warning,
    when it has not the shape this was written for."""
    original = getattr(scheduler, "job_selector", None)
    if not callable(original):
        log.warning("ddppipe: %s has no job_selector: the rules beside a training wait for "
                    "a free core", scheduler.__name__)  # fmt: skip
        return False
    if getattr(original, "ddppipe_beside", False):
        return True  # installed already

    @functools.wraps(original)
    def job_selector(self: Any, jobs: Sequence[Any]) -> Any:
        resources, lock = getattr(self, "resources", None), getattr(self, "_lock", None)
        if not isinstance(resources, dict) or lock is None or resources.get(CORES) != 0:
            return original(self, jobs)
        beside = [job for job in jobs if _needs_no_core(job)]
        if not beside:
            return original(self, jobs)
        return _with_a_lent_core(resources, lock, lambda: original(self, beside))

    job_selector.ddppipe_beside = True  # type: ignore[attr-defined]
    scheduler.job_selector = job_selector
    return True


def _with_a_lent_core(resources: dict, lock: Any, select: Callable[[], Any]) -> Any:
    """``select()`` with one core more in ``resources`` (taken back after: a job ending in
    between adds its own cores, which stay)."""
    with lock:
        resources[CORES] += 1
    try:
        return select()
    finally:
        with lock:
            resources[CORES] -= 1
