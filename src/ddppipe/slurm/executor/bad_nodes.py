"""Nodes that failed the preflight, excluded from the run's next slot, within a cap.

A node whose own check fails in the preflight (ddppipe.launching.preflight: it does not see the
shared filesystem, its GPUs are unusable, ...) while the allocation's other nodes pass is a bad
node, not a bad run: the launcher records it in the run's state folder
(``excluded-nodes.json``) and in the attempt history, and fails the slot; the submitting
Snakemake's retry of the training job (the profile's ``retries``) passes every node recorded
there to ``sbatch --exclude`` (ddppipe.slurm.executor.attach wraps the plugin's submission), so the
next slot runs on other nodes. A running job's ``ExcNodeList`` cannot be changed (SLURM
accepts it for pending jobs only) and a job that requeues itself lands on the same nodes
again, so the next slot is a new submission. At most ``slurm.max_excluded_nodes`` nodes are
excluded for a run; past that, or when every node of the allocation fails the same check (a
problem of the run or the image, not of a node), the run fails as before.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ddppipe.core import atomic
from ddppipe.runstate.state import StateDir

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Decision:
    """What to do with a preflight failure: the nodes now excluded (empty: fail the run), and
    the sentence for the attempt history and the log."""

    excluded: list[str]
    reason: str


def load(state: StateDir) -> list[str]:
    """The nodes excluded for the run so far; none when the file is missing or unreadable."""
    try:
        nodes = json.loads(state.excluded_nodes.read_text())
    except (OSError, ValueError):
        return []
    return [str(n) for n in nodes] if isinstance(nodes, list) else []


def decide(failing: list[str], hosts: list[str], excluded: list[str], cap: int) -> Decision:
    """Exclude ``failing`` (the nodes whose own check failed among the slot's ``hosts``), given
    the run's ``excluded`` so far and the cap ``slurm.max_excluded_nodes``?"""
    named = ", ".join(failing)
    if not failing:
        return Decision([], "the preflight failure names no node of its own")
    if set(failing) >= set(hosts):
        return Decision(
            [], f"every node of the slot failed ({named}): a problem of the run, not of a node"
        )
    new = [n for n in failing if n not in excluded]
    if len(excluded) + len(new) > cap:
        return Decision(
            [],
            f"{named} failed the preflight and slurm.max_excluded_nodes ({cap}) is reached "
            f"(excluded so far: {', '.join(excluded) or 'none'}): repair the nodes or raise it",
        )
    total = [*excluded, *new]
    return Decision(
        total,
        f"{named} failed the preflight: excluded from the next slot ({len(total)} of "
        f"slurm.max_excluded_nodes {cap} excluded: {', '.join(total)})",
    )


def record(state: StateDir, nodes: list[str]) -> None:
    """Write the run's excluded nodes (the whole list)."""
    atomic.write_json(state.excluded_nodes, nodes)


def install(executor: type, state_of: Callable[[Any], StateDir | None]) -> bool:
    """Make ``executor`` (the SLURM plugin's class) exclude, from a job's submission, the nodes
    recorded in the state folder ``state_of(job)`` names (None: not a training job); False,
    with a warning, when its interface is not the one this was written for."""
    original = getattr(executor, "run_job", None)
    if original is None or not isinstance(getattr(executor, "_failed_nodes", None), property):
        log.warning(
            "ddppipe: %s has no run_job or excluded nodes: a node that failed the preflight "
            "is not excluded from the next submission",
            executor.__name__,
        )
        return False
    if getattr(original, "_ddppipe_bad_nodes", False):
        return True

    def run_job(self: Any, job: Any) -> None:
        state = None if job.is_group() else state_of(job)
        nodes = load(state) if state is not None else []
        new = [n for n in nodes if n not in self._failed_nodes]
        if new:
            self.logger.info(
                f"ddppipe: excluding {', '.join(new)} from SLURM submissions: failed the "
                f"preflight of rule {job.name} ({state.excluded_nodes})"
            )
            for node in new:
                self._failed_nodes.add(node)
        original(self, job)

    run_job._ddppipe_bad_nodes = True  # type: ignore[attr-defined]
    executor.run_job = run_job
    return True
