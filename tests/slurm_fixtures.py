"""Pytest fixtures for the two-node SLURM test cluster (see ``tests/slurm_cluster.py``).

Import them into ``conftest.py``::

    from tests.slurm_fixtures import (  # noqa: F401
        slurm_accounting_cluster, slurm_cluster, slurm_slot,
    )

Only one cluster can run per machine, so a session-wide :class:`SlurmSlot`
owns it: ``slurm_cluster`` is the session's plain cluster, shaped unlike a default
one on purpose: nodes ``cn07``, ``cn08`` (the hostlist ``cn[07-08]``), a default
partition ``short`` and a non-default one ``train`` that the workflow tests train
in; ``slurm_accounting_cluster`` is a cluster with slurmdbd + MariaDB instead.
Each starts on first use and keeps running (its jobs, job ids and sacct records
too) until a test needs the other one or a cluster of its own
(``SlurmSlot.suspended``); the next test that needs it starts it again, from fresh
state (job ids from 1 again). A switch costs 3 to 7 s, so the tests of one cluster
run next to each other.

Without root or the Slurm packages (``bash .ci/install_slurm.sh``) the
fixtures skip, except under CI (``CI`` set), where they fail.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.slurm_cluster import (
    CTLD_PORT,
    PREEMPT_GRACE_S,
    SBIN_PATH,
    URGENT_PARTITION,
    SlurmCluster,
    port_listening,
)

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


def bench_cluster_refused() -> bool:
    """Whether a benchmark cannot start the test cluster here now (not root, no Slurm, another
    test cluster running); if so, why, on stderr (the benchmark then exits 2)."""
    reason = slurm_unavailable_reason()
    if reason is None and port_listening(CTLD_PORT):
        reason = f"a test cluster already runs on this machine (port {CTLD_PORT}): wait for it"
    if reason is not None:
        print(f"cannot run the SLURM test cluster: {reason}", file=sys.stderr)
    return reason is not None


# The accounting cluster samples its steps' usage (jobacct_gather/linux), so sacct has their
# MaxRSS and TotalCPU as at a site; every second, not a site's 30 s: a test's step of a few
# seconds would get no sample.
ACCOUNTING_SETTINGS = {
    "JobAcctGatherType": "jobacct_gather/linux",
    "JobAcctGatherFrequency": "task=1",
}


class SlurmSlot:
    """The one cluster a machine can run: the session's plain or accounting cluster, started
    on demand and left running until a test needs another."""

    def __init__(self, make_workdir: Callable[[str], Path]) -> None:
        self._make_workdir = make_workdir
        self._clusters: dict[str, SlurmCluster] = {}
        self._running: SlurmCluster | None = None

    def cluster(self) -> SlurmCluster:
        """The plain (no accounting) cluster, running."""
        return self._use("slurm", nodes=SESSION_NODES, partitions=SESSION_PARTITIONS)

    def accounting_cluster(self) -> SlurmCluster:
        """The cluster with slurmdbd (default shape: node1, node2, partition ``debug``), running."""
        return self._use("slurm-acct", accounting=True, settings=ACCOUNTING_SETTINGS)

    def _use(self, name: str, **shape: Any) -> SlurmCluster:
        """The session's cluster ``name``, started (the other one stopped) unless it runs."""
        if name not in self._clusters:
            self._clusters[name] = self.new_cluster(name, **shape)
        cluster = self._clusters[name]
        if self._running is not cluster or not cluster.running:
            self._stop()
            cluster.start()
            self._running = cluster
        else:
            clear_queue(cluster)
        return cluster

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Stop the running cluster for the block, so another can run; the next test that needs
        it starts it again."""
        self._stop()
        yield

    def new_cluster(self, name: str, accounting: bool = False, **shape: Any) -> SlurmCluster:
        """An unstarted cluster in a fresh work directory (start it inside ``suspended()``);
        ``shape``: SlurmCluster's nodes, partitions, settings."""
        return SlurmCluster(self._make_workdir(name), accounting=accounting, **shape)

    def close(self) -> None:
        self._stop()

    def _stop(self) -> None:
        if self._running is not None:
            self._running.stop()
            self._running = None


def clear_queue(cluster: SlurmCluster, timeout: float = 60) -> None:
    """Cancel the jobs an earlier test left (one that failed before its snakemake could
    cancel them) and wait until they are gone: each test starts on an idle cluster."""
    deadline = time.monotonic() + timeout
    while cluster.run(["squeue", "-h", "-o", "%i"]).stdout.split():
        if time.monotonic() > deadline:
            raise TimeoutError(f"jobs still queued after {timeout:.0f}s of scancel")
        cluster.run(["scancel", f"--user={getpass.getuser()}"])
        time.sleep(0.5)


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


@pytest.fixture
def slurm_cluster(slurm_slot: SlurmSlot) -> SlurmCluster:
    """The session's two-node cluster (cn07, cn08; 2 CPUs and 2 fake GPUs each), no
    accounting, running."""
    return slurm_slot.cluster()


@pytest.fixture
def slurm_accounting_cluster(slurm_slot: SlurmSlot) -> SlurmCluster:
    """The session's cluster with slurmdbd, so ``sacct`` works (node1, node2; 2 CPUs each),
    running; see ``ACCOUNTING_SETTINGS``."""
    return slurm_slot.accounting_cluster()
