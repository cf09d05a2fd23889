"""A sweep's trials start in its order: Snakemake's scheduler, extended.

Snakemake picks among the ready jobs in no promised order (its selectors rank them by their
``priority:``, then by the size of their input files: a trial whose config is longer, ``lr:
1.0e-05`` against ``lr: 0.05``, went first). The train rule's ``priority:`` is each trial's
place in the sweep (:func:`priority`), so among ready trials the earlier ones are chosen; but
a priority orders only jobs ready together: a trial whose config was written a moment before
the trial ahead of it would take the free slot.

:func:`install` wraps the selector: a trial's training is offered only once every earlier
trial's has started, is offered with it, or can never start (a job it needs failed), and the
jobs selected are handed to the executor in the trials' order (the SLURM plugin submits with
two threads: two trials selected in one pass may still get their job ids in either order).
``order(job)`` is a job's place (0: the first trial), None for a job that is no trial's
training; jobs of that kind are offered as always. On a scheduler of another shape it warns
and changes nothing.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Collection, Iterable
from typing import Any

log = logging.getLogger(__name__)
Order = Callable[[Any], int | None]  # a job's place in its sweep; None: not a trial's training


def priority(place: int, trials: int) -> int:
    """The ``priority:`` of the training of the trial at ``place`` of ``trials`` (>= 1: above
    every other job's 0, the earlier the higher; integers, so Snakemake's ILP selector never
    trades a place for cores)."""
    return max(trials - place, 1)


def install(scheduler: type, order: Order) -> bool:
    """Wrap ``scheduler.job_selector`` (Snakemake's JobScheduler); False, with a warning,
    when it has not the shape this was written for."""
    original = getattr(scheduler, "job_selector", None)
    if not callable(original):
        log.warning("ddppipe: %s has no job_selector: trials start in no promised order",
                    scheduler.__name__)  # fmt: skip
        return False
    if getattr(original, "ddppipe_in_order", False):
        return True  # installed already

    @functools.wraps(original)
    def job_selector(self: Any, jobs: Collection[Any]) -> Any:
        dag, failed = self.workflow.dag, getattr(self, "failed", set())
        first = first_waiting(dag, failed, order, jobs)
        offered = [job for job in jobs if _before(_place(order, job), first)]
        return in_place(original(self, offered), order)

    job_selector.ddppipe_in_order = True  # type: ignore[attr-defined]
    scheduler.job_selector = job_selector
    return True


def _place(order: Order, job: Any) -> int | None:
    return None if job.is_group() else order(job)


def _before(place: int | None, first: int | None) -> bool:
    """Whether a job of ``place`` may start while the trial at ``first`` waits."""
    return place is None or first is None or place < first


def first_waiting(
    dag: Any, failed: Collection[Any], order: Order, ready: Iterable[Any]
) -> int | None:
    """The place of the first trial whose training waits for a job it needs (not ready, not
    started, and no job it needs failed); None when none waits. The trials are looked at in
    their order, up to the first that waits (a large sweep's DAG is not walked whole at
    every selection)."""
    ready = set(ready) | set(dag.ready_jobs)
    trials = [(place, job) for job in dag.needrun_jobs()
              if (place := _place(order, job)) is not None]  # fmt: skip
    for place, job in sorted(trials, key=lambda trial: trial[0]):
        if job in ready or dag.is_running(job) or _doomed(dag, job, failed):
            continue
        return place
    return None


def _doomed(dag: Any, job: Any, failed: Collection[Any]) -> bool:
    """Whether a job ``job`` needs (itself included) failed for good: it never starts."""
    return any(j in failed for j in dag.bfs(dag.dependencies, job, stop=dag.noneedrun_finished))


def in_place(selected: Iterable[Any], order: Order) -> list[Any]:
    """``selected`` with the trials' trainings first, in their order (the others after)."""
    places = {job: _place(order, job) for job in selected}
    return sorted(places, key=lambda job: (places[job] is None, places[job] or 0))
