"""A training job's submission excludes the bad nodes its run recorded.

The launcher records a node that failed its own checks as a slot started in the run's bad-node
record (:mod:`ddppipe.slurm.bad_nodes`) and fails the slot; the submitting Snakemake's retry of the
training job (the profile's ``retries``) is the next slot. :func:`install` wraps the plugin's
submission: the nodes recorded join the plugin's own exclusions (``_failed_nodes``, the nodes of its
failed jobs), which it passes to ``sbatch --exclude``, so the next slot runs on other nodes. A
running job's ``ExcNodeList`` cannot be changed (SLURM accepts it for pending jobs only) and a job
that requeues itself lands on the same nodes again, so the next slot is a new submission.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ddppipe.runstate.state import StateDir
from ddppipe.slurm import bad_nodes

log = logging.getLogger(__name__)


def install(executor: type, state_of: Callable[[Any], StateDir | None]) -> bool:
    """Make ``executor`` (the SLURM plugin's class) exclude, from a job's submission, the nodes
    recorded in the state folder ``state_of(job)`` names (None: not a training job); False,
    with a warning, when its interface is not the one this was written for."""
    original = getattr(executor, "run_job", None)
    if original is None or not isinstance(getattr(executor, "_failed_nodes", None), property):
        log.warning(
            "ddppipe: %s has no run_job or excluded nodes: a node recorded bad (failed its "
            "checks, or lost mid-step) is not excluded from the next submission",
            executor.__name__,
        )
        return False
    if getattr(original, "_ddppipe_bad_nodes", False):
        return True

    def run_job(self: Any, job: Any) -> None:
        state = None if job.is_group() else state_of(job)
        if state is not None:
            record = bad_nodes.of_run(state)
            new = [n for n in record.load() if n not in self._failed_nodes]
            if new:
                self.logger.info(
                    f"ddppipe: excluding {', '.join(new)} from SLURM submissions of rule "
                    f"{job.name}: recorded bad by its run (failed its checks, or lost "
                    f"mid-step: {record.path})"
                )
                for node in new:
                    self._failed_nodes.add(node)
        original(self, job)

    run_job._ddppipe_bad_nodes = True  # type: ignore[attr-defined]
    executor.run_job = run_job
    return True
