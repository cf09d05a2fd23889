"""A packed sweep's allocations: the sbatch request of one (a trial's request, times the
trials it holds, without the pool's bad nodes), submitting one while trials wait and fewer than
``sweep.pack.allocations`` are held, and which of those SLURM still queues or runs."""

from __future__ import annotations

import logging
import shlex
import sys
import time
from dataclasses import dataclass, replace

from ddppipe.core import atomic
from ddppipe.core.errors import UserError
from ddppipe.packing.pool import Pool
from ddppipe.settings.run_spec import Pack, RunSpec, SweepSection
from ddppipe.slurm import bad_nodes, sbatch, squeue
from ddppipe.slurm.allocation_request import AllocationRequest
from ddppipe.slurm.request import Request, pinned_mb

log = logging.getLogger(__name__)

CHECK_EVERY_S = 10.0  # how often waiting train jobs ask SLURM (one squeue per pool, at most)
SBATCH_TIMEOUT_S = 120.0
# squeue states of an allocation that holds or will hold its nodes
LIVE_STATES = frozenset({"PENDING", "RUNNING", "CONFIGURING", "REQUEUED", "RESIZING", "SUSPENDED"})


class PackError(ValueError, UserError):
    """A packed sweep that cannot run as configured."""


@dataclass(frozen=True)
class Allocation:
    """One held allocation's request: ``pack.nodes`` nodes, each with ``pack.trials_per_node``
    trials' CPUs, memory and GPUs (a trial's own on each of its nodes:
    :class:`ddppipe.slurm.request.Request`)."""

    trial: Request
    pack: Pack
    sweep: str
    precision: str  # the trial's recipe's (its nodes' preflight checks it)
    spec: RunSpec  # the trial's (what its checkpoints pin: :attr:`mem_mb`)

    @classmethod
    def of(cls, spec: RunSpec) -> Allocation:
        """The allocation of a packed trial's spec; PackError for a trial it cannot hold."""
        pack = spec.trial.pack if spec.trial is not None else None
        if pack is None or spec.trial is None:
            raise PackError(f"run {spec.run} is no trial of a packed sweep (sweep.pack)")
        request = Request.from_spec(spec)
        if request.nodes > pack.nodes:
            raise PackError(
                f"{spec.run} asks for launch.nnodes {request.nodes}, but the sweep's allocations "
                f"have sweep.pack.nodes {pack.nodes}: raise sweep.pack.nodes to at least "
                f"{request.nodes}, or remove sweep.pack (one SLURM job per trial)"
            )
        if request.nodes > 1 and request.rendezvous_host:
            raise PackError(
                f"slurm.rendezvous_host ({request.rendezvous_host}) names one node, but a packed "
                f"trial of {request.nodes} nodes runs on whichever nodes of its allocation have "
                "a free slot: set slurm.rendezvous_host: null (its first node hosts it)"
            )
        if request.signal_seconds >= pack.time_min * 60:
            raise PackError(
                f"slurm.signal_seconds ({request.signal_seconds}) must be shorter than "
                f"sweep.pack.time_min ({pack.time_min} min): the trials would be warned of the "
                "allocation's end before they start; raise time_min or lower signal_seconds"
            )
        return cls(request, pack, spec.trial.sweep, spec.train.precision, spec)

    @property
    def use(self) -> str:
        return "gpu" if self.trial.gpus_per_node else "cpu"

    @property
    def job_name(self) -> str:
        return f"ddppipe-pack-{self.sweep}"

    @property
    def cpus_per_node(self) -> int:
        return self.trial.cpus_per_node * self.pack.trials_per_node

    @property
    def gpus_per_node(self) -> int:
        return self.trial.gpus_per_node * self.pack.trials_per_node

    @property
    def mem_mb(self) -> int:
        """A node's memory: ``pack.trials_per_node`` trials' requests, fitted to the partition's
        nodes (each trial's share capped; ``slurm.mem_mb`` above it refused before any sbatch:
        :meth:`ddppipe.slurm.request.Request.fitted_mem_mb`)."""
        trial = self.trial
        if trial.estimates([]):  # a GPU trial's estimate counts what its checkpoints pin
            trial = replace(trial, pinned_mb=pinned_mb(self.spec))  # (the task built on meta)
        return trial.fitted_mem_mb(trial.mem_mb, self.pack.trials_per_node, self.pack.nodes)

    def sbatch(self, pool: Pool, workdir: str) -> list[str]:
        """The ``sbatch`` command line of one allocation (:mod:`ddppipe.slurm.allocation_request`):
        a ``ddppipe pack-worker`` on each node, its output in the pool's ``allocations/``."""
        slurm = self.trial.slurm
        request = AllocationRequest(
            self.job_name, self.pack.nodes, self.cpus_per_node, self.mem_mb, self.gpus_per_node,
            self.pack.time_min, slurm, pool.bad_nodes.exclude(),
        )  # fmt: skip
        worker = [
            sys.executable, "-m", "ddppipe", "pack-worker", "--pool", str(pool.root),
            "--slots", str(self.pack.trials_per_node),
            "--signal-seconds", str(slurm.signal_seconds), "--stop-signal", slurm.stop_signal,
            "--nproc", str(self.trial.procs_per_node), "--use", self.use,
            "--precision", self.precision,
        ]  # fmt: skip
        return request.sbatch(worker, str(pool.allocations / "%j.log"), workdir)


def trials_at_once(sweep: SweepSection) -> int:
    """A sweep's train jobs at once: ``max_parallel``; a packed sweep's, two per slot of its
    allocations (one training, one waiting: a slot that frees takes the next trial at once,
    while Snakemake starts the next train job, seconds for a local job)."""
    pack = sweep.pack
    return sweep.max_parallel if pack is None else 2 * pack.allocations * pack.slots


def held(pool: Pool) -> list[str]:
    """The pool's allocations SLURM still queues or runs (their job ids)."""
    submitted = [r["job"] for r in pool.records(pool.allocations) if "job" in r]
    if not submitted:
        return []
    return [job for job, state in squeue.states(submitted).items() if state in LIVE_STATES]


def exclude_bad_nodes(pool: Pool, cap: int) -> bad_nodes.Decision | None:
    """Decide on the nodes whose preflight failed in the pool's allocations since the last
    decision (None: there is none), as a run decides on its slot's (ddppipe.slurm.bad_nodes):
    recorded in the pool's bad-node record, which its next allocations ``--exclude``, within
    the cap ``slurm.max_excluded_nodes``; past it, the waiting trials are refused (their train
    jobs fail, saying why) instead of landing on the node again. Each node of a pool checks
    itself alone, so a node that failed is a bad node even when the allocation had no other."""
    failed = pool.failed_preflight()
    if not failed:
        return None
    record = pool.bad_nodes
    decision = record.add(list(failed), None, cap, bad_nodes.NEXT_ALLOCATIONS)
    if decision.excluded:
        log.error("%s", decision.reason)
    else:
        log.error("not excluding: %s", decision.reason)
        refused = pool.refuse_waiting(decision.reason)
        if refused:
            log.error("refused the waiting trial(s) %s", ", ".join(refused))
    pool.decided([p for paths in failed.values() for p in paths], decision.reason)
    return decision


def ensure(pool: Pool, allocation: Allocation, workdir: str, force: bool = False) -> str | None:
    """Submit an allocation when trials wait that the held ones have no slot for and fewer
    than ``pack.allocations`` are held; its job id, or None. At most one pool check every
    :data:`CHECK_EVERY_S` seconds (``force``: now)."""
    with pool.lock():
        stamp = pool.root / ".checked"
        if not force and stamp.exists() and time.time() - stamp.stat().st_mtime < CHECK_EVERY_S:
            return None
        stamp.touch()
        held_now = held(pool)
        for run in pool.reclaim(held_now):
            log.warning("%s: its allocation ended before it stopped; it waits again", run)
        exclude_bad_nodes(pool, allocation.trial.slurm.max_excluded_nodes)
        live = [job for job in held_now if not pool.stopping(job)]  # (ending: a successor)
        waiting = pool.waiting()
        if not waiting:
            return None
        free = len(live) * allocation.pack.slots - pool.training()
        if waiting <= free or len(live) >= allocation.pack.allocations:
            return None
        command = allocation.sbatch(pool, workdir)
        try:
            job = sbatch.submit(command, timeout=SBATCH_TIMEOUT_S)
        except sbatch.SbatchError as e:
            raise PackError(
                f"sbatch of an allocation failed: {e}\n  {shlex.join(command)}"
            ) from None
        atomic.write_json(pool.allocations / f"{job}.json",
                          {"job": job, "submitted": time.time(), "command": command})  # fmt: skip
        log.info("submitted allocation %s (%d trial(s) waiting, %d held)", job, waiting, len(live))
        return job
