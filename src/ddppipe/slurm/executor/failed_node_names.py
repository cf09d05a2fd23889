"""After a node failure, the SLURM plugin keeps submitting: its exclusion list holds node names.

snakemake-executor-plugin-slurm (2.8.0) excludes the node of a ``NODE_FAIL`` job from later
submissions, asking ``sacct -j JOB -X -o nodelist``. When the job has already been requeued
(``slurm-requeue: true``) sacct answers ``None assigned``, and every later ``sbatch`` gets
``--exclude=None assigned,...``: sbatch reads ``assigned,...`` as its script and fails, for
every rule and retry of the workflow (upstream issue #485, open; seen in this project's CI
after a test took a node down). :func:`install` makes the executor's ``_failed_nodes`` a set
that keeps only node names and hostlists (:func:`ddppipe.slurm.bad_nodes.is_node_name`, which
the bad-node record's reader applies too).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from ddppipe.slurm.bad_nodes import is_node_name

log = logging.getLogger(__name__)
ATTRIBUTE = "_failed_nodes"


class NodeNames(set):
    """A set of node names that ignores anything else added to it."""

    def __init__(self, values: Iterable[str] = ()) -> None:
        super().__init__(v for v in values if is_node_name(v))

    def add(self, value: str) -> None:
        if is_node_name(value):
            super().add(value)
        else:
            log.debug("ddppipe: not excluding %r from submissions: no node name", value)


def _get(self: Any) -> NodeNames:
    nodes = self.__dict__.get(ATTRIBUTE, ())
    if not isinstance(nodes, NodeNames):  # an executor made before install()
        nodes = self.__dict__[ATTRIBUTE] = NodeNames(nodes)
    return nodes


def _set(self: Any, values: Iterable[str]) -> None:
    self.__dict__[ATTRIBUTE] = NodeNames(values)


def install(executor: type) -> None:
    """Make ``executor``'s (the SLURM plugin's class) excluded nodes a :class:`NodeNames`, also
    on an instance made before."""
    if not isinstance(getattr(executor, ATTRIBUTE, None), property):
        setattr(executor, ATTRIBUTE, property(_get, _set))
