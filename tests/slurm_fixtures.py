"""Pytest fixtures for the two-node SLURM test cluster (see ``tests/slurm_cluster.py``).

Import them into ``conftest.py``::

    from tests.slurm_fixtures import (  # noqa: F401
        slurm_accounting_cluster, slurm_cluster, slurm_slot,
    )

Only one cluster can run per machine, so a session-wide :class:`SlurmSlot`
owns it: ``slurm_cluster`` is the session's plain cluster (started on first
use), shaped unlike a default one on purpose: nodes ``cn07``, ``cn08`` (the
hostlist ``cn[07-08]``), a default partition ``short`` and a non-default one
``train`` that the workflow tests train in; ``slurm_accounting_cluster``
suspends it for the length of one test, runs a cluster with slurmdbd + MariaDB
instead, and restarts the plain one after (same object, fresh state: job ids start again at 1).

Without root or the Slurm packages (``bash .ci/install_slurm.sh``) the
fixtures skip, except under CI (``CI`` set), where they fail.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.slurm_cluster import PREEMPT_GRACE_S, SBIN_PATH, URGENT_PARTITION, SlurmCluster

SESSION_NODES = ("cn07", "cn08")  # the hostlist cn[07-08]
TRAIN_PARTITION = "train"  # not the default partition
_PREEMPTIBLE = (
    f"MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime={PREEMPT_GRACE_S}"
)
SESSION_PARTITIONS = {
    "short": f"Default=YES {_PREEMPTIBLE}",
    TRAIN_PARTITION: _PREEMPTIBLE,
    URGENT_PARTITION: "MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF",
}

REQUIRED_BINARIES = ("slurmctld", "slurmd", "sbatch", "munged", "nsenter", "unshare", "ip")


def slurm_unavailable_reason() -> str | None:
    """Why the test cluster cannot run here, or None if it can."""
    if os.geteuid() != 0:
        return "the SLURM test cluster needs root (network namespaces, /etc/hosts)"
    path = f"{os.environ.get('PATH', '')}:{SBIN_PATH}"
    missing = [b for b in REQUIRED_BINARIES if shutil.which(b, path=path) is None]
    if missing:
        return f"missing {', '.join(missing)}: run `bash .ci/install_slurm.sh` as root"
    return None


class SlurmSlot:
    """The one cluster a machine can run: the session's plain cluster, which tests may suspend."""

    def __init__(self, make_workdir: Callable[[str], Path]) -> None:
        self._make_workdir = make_workdir
        self._cluster: SlurmCluster | None = None

    def cluster(self) -> SlurmCluster:
        """The plain (no accounting) cluster, started if it is not running."""
        if self._cluster is None:
            self._cluster = SlurmCluster(
                self._make_workdir("slurm"), nodes=SESSION_NODES, partitions=SESSION_PARTITIONS
            )
        if not self._cluster.running:
            self._cluster.start()
        return self._cluster

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Stop the plain cluster for the block, so another can run; restart it after if it ran."""
        was_running = self._cluster is not None and self._cluster.running
        if self._cluster is not None:
            self._cluster.stop()
        try:
            yield
        finally:
            if was_running:
                self.cluster()

    def new_cluster(self, name: str, accounting: bool = False, **shape: Any) -> SlurmCluster:
        """An unstarted cluster in a fresh work directory (start it inside ``suspended()``);
        ``shape``: SlurmCluster's nodes, partitions, settings."""
        return SlurmCluster(self._make_workdir(name), accounting=accounting, **shape)

    def close(self) -> None:
        if self._cluster is not None:
            self._cluster.stop()


@pytest.fixture(scope="session")
def slurm_slot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmSlot]:
    """The session's SLURM slot; skips (fails under CI) where no cluster can run."""
    reason = slurm_unavailable_reason()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    slot = SlurmSlot(lambda name: tmp_path_factory.mktemp(name))
    yield slot
    slot.close()


@pytest.fixture(scope="session")
def slurm_cluster(slurm_slot: SlurmSlot) -> SlurmCluster:
    """A started two-node cluster (cn07, cn08; 2 CPUs and 2 fake GPUs each), no accounting."""
    return slurm_slot.cluster()


@pytest.fixture
def slurm_accounting_cluster(slurm_slot: SlurmSlot) -> Iterator[SlurmCluster]:
    """A started cluster with slurmdbd, so ``sacct`` works (suspends ``slurm_cluster``);
    the default shape: node1, node2, one default partition ``debug``. Its steps' usage is
    sampled (jobacct_gather/linux), so sacct has their MaxRSS and TotalCPU, as at a site;
    every second, not a site's 30 s: a test's step of a few seconds would get no sample."""
    gather = {"JobAcctGatherType": "jobacct_gather/linux", "JobAcctGatherFrequency": "task=1"}
    with (
        slurm_slot.suspended(),
        slurm_slot.new_cluster("slurm-acct", accounting=True, settings=gather) as cluster,
    ):
        yield cluster
