"""Nodes found bad, excluded from later SLURM submissions: the one record of them.

A node whose own check fails as a slot's processes start (it does not see the shared
filesystem, its GPUs are unusable, ...: :mod:`ddppipe.parallel.node_check`) is a bad node,
and so is a node lost mid-step in a job that survives it (``slurm.spare_nodes``,
``slurm.min_nodes``: ddppipe.launching.lifecycle). It is recorded in ``excluded-nodes.json``
of the folder whose submissions exclude it, in one format (a JSON list of node names, in the
order they were excluded), read by :meth:`BadNodes.load`, written by :meth:`BadNodes.save`
(one atomic write), decided within one cap (:func:`decide`, ``slurm.max_excluded_nodes``) and
passed to ``sbatch --exclude`` by :meth:`BadNodes.exclude`. Two folders keep one:

- a run's state folder (``results/<run>/state``, :func:`of_run`): the launcher
  (ddppipe.launching.lifecycle) records a node that failed its check while the slot's other
  nodes passed, and fails the slot; the retry of the training job, submitted by the
  SLURM plugin, excludes the nodes recorded (ddppipe.slurm.executor.exclusions adds them to
  the plugin's exclusions, which it passes to ``sbatch --exclude``). When every node of the slot
  fails the same check (a problem of the run or the image, not of a node), none is recorded.
- a packed sweep's pool (``results/sweeps/<sweep>/pack``): its trials share the pool's
  allocations, so a node that failed its check in one of them is recorded for the pool
  (ddppipe.packing.allocation) and excluded from its next allocations.

Either keeps at most ``slurm.max_excluded_nodes`` nodes; past that the run fails (a packed
sweep: its waiting trials are refused). Deleting the file once the nodes are repaired ends
their exclusion. The reader keeps node names only (:func:`is_node_name`): a placeholder such
as ``None assigned`` never reaches ``--exclude``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from ddppipe.core import atomic
from ddppipe.runstate.state import StateDir

log = logging.getLogger(__name__)
FILE = "excluded-nodes.json"  # in a run's state folder and in a packed sweep's pool folder
PLACEHOLDERS = ("None", "(null)", "Unknown")  # what sacct and scontrol say for no node
NEXT_SLOT = "the next slot"  # what a run's exclusion keeps a node from
NEXT_ALLOCATIONS = "the pool's next allocations"  # a packed sweep's
NEXT_STEPS = "the job's next steps and the run's next slots"  # a node lost mid-step
PREFLIGHT = "failed the preflight"
LOST = "lost mid-step"


def is_node_name(value: str) -> bool:
    """A node name or hostlist (``cn07``, ``gpu-a[01-04]``), not a placeholder or free text."""
    return bool(value) and value not in PLACEHOLDERS and not any(c.isspace() for c in value)


@dataclass(frozen=True)
class Decision:
    """What to do with a preflight failure: the nodes now excluded (empty: fail the run, or
    refuse the pool's waiting trials), and the sentence for the attempt history and the log."""

    excluded: list[str]
    reason: str


def decide(
    failing: list[str], hosts: list[str] | None, excluded: list[str], cap: int,
    keeps_from: str = NEXT_SLOT, failed: str = PREFLIGHT,
) -> Decision:  # fmt: skip
    """Exclude ``failing`` (the nodes whose own check failed among the slot's ``hosts``; None:
    a pool's nodes, each checked alone), given the ``excluded`` so far and the cap
    ``slurm.max_excluded_nodes``? ``keeps_from``: what the exclusion keeps them from;
    ``failed``: what they did (failed the preflight, were lost mid-step)."""
    named = ", ".join(failing)
    if not failing:
        return Decision([], "the preflight failure names no node of its own")
    if hosts is not None and set(failing) >= set(hosts):
        return Decision(
            [], f"every node of the slot failed ({named}): a problem of the run, not of a node"
        )
    new = [n for n in failing if n not in excluded]
    if len(excluded) + len(new) > cap:
        return Decision(
            [],
            f"{named} {failed} and slurm.max_excluded_nodes ({cap}) is reached "
            f"(excluded so far: {', '.join(excluded) or 'none'}): repair the nodes or raise it",
        )
    total = [*excluded, *new]
    return Decision(
        total,
        f"{named} {failed}: excluded from {keeps_from} ({len(total)} of "
        f"slurm.max_excluded_nodes {cap} excluded: {', '.join(total)})",
    )


@dataclass(frozen=True)
class BadNodes:
    """The record of the nodes a folder's submissions exclude (``path``: its file)."""

    path: Path

    @classmethod
    def in_folder(cls, folder: Path) -> BadNodes:
        return cls(folder / FILE)

    def load(self) -> list[str]:
        """The nodes excluded so far; none when the file is missing or unreadable."""
        try:
            nodes = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return []
        return [str(n) for n in nodes if is_node_name(str(n))] if isinstance(nodes, list) else []

    def save(self, nodes: list[str]) -> None:
        """Write the nodes excluded (the whole list)."""
        atomic.write_json(self.path, nodes)

    def add(
        self, failing: list[str], hosts: list[str] | None, cap: int,
        keeps_from: str = NEXT_SLOT, failed: str = PREFLIGHT,
    ) -> Decision:  # fmt: skip
        """:func:`decide` on ``failing`` given the nodes recorded, and record them when they
        are excluded."""
        decision = decide(failing, hosts, self.load(), cap, keeps_from, failed)
        if decision.excluded:
            self.save(decision.excluded)
        return decision

    def exclude(self) -> str | None:
        """The value of ``sbatch --exclude``: the nodes recorded; None when there is none."""
        return ",".join(self.load()) or None


def of_run(state: StateDir) -> BadNodes:
    """A run's record, in its state folder (the same file as earlier releases')."""
    return BadNodes(state.excluded_nodes)
