"""The SLURM request of a training run: one object, derived from the run spec.

:class:`Request` is derived once from a run spec. Both the train rule's Snakemake resources
(the plugin's sbatch line) and the srun step and torchrun arguments of the job come from it,
so nodes, CPUs and GPUs cannot disagree between them. Its shape is one task per node
(``--ntasks-per-node=1``): ``ddppipe agent`` (torchrun) starts that node's training processes,
so a task holds the CPUs (and GPUs) of all of them.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from typing import Any

from ddppipe import tasks
from ddppipe.core.errors import UserError
from ddppipe.core.rendezvous import first_host, job_port, step_nodelist, step_port
from ddppipe.parallel import startup_limits
from ddppipe.runstate import attempts
from ddppipe.runstate.attempts import Attempt
from ddppipe.runstate.state import StateDir
from ddppipe.settings import layout, run_spec
from ddppipe.settings.run_spec import RunSpec
from ddppipe.settings.runs import Runs
from ddppipe.slurm import memory_request, sinfo
from ddppipe.slurm.placement import Placement
from ddppipe.slurm.scontrol import job_id

log = logging.getLogger(__name__)
# Every resource Request.resources() may set (None where a request leaves it out).
RESOURCE_KEYS = (
    "nodes", "tasks", "cpus_per_task", "mem_mb", "runtime", "slurm_partition", "slurm_account",
    "constraint", "qos", "mpi", "gres", "tasks_per_gpu", "slurm_extra",
)  # fmt: skip


class SlurmRequestError(ValueError, UserError):
    """The SLURM request the config describes cannot work; the message says how to fix it."""


@dataclass(frozen=True)
class Request:
    """The training job's shape and SLURM options: the run spec's ``launch`` and ``slurm``
    sections, read as they are, and what is derived from them (GPUs, memory)."""

    launch: run_spec.Launch
    slurm: run_spec.Slurm
    gpus_per_node: int  # the run trains on GPUs: one per process; 0 otherwise
    step_nodes: int | None = None  # a smaller world after a node failure (:meth:`on_nodes`)
    pinned_mb: int = 0  # a GPU process's pinned checkpoint copy (:func:`pinned_mb`); 0: unknown

    @classmethod
    def from_spec(cls, spec: RunSpec) -> Request:
        """The request of a run; raise SlurmRequestError for one that cannot work."""
        gpus = spec.launch.nproc_per_node if spec.gpus else 0  # one GPU per process
        request = cls(spec.launch, spec.slurm, gpus)
        least = request.least_mem_mb
        if request.mem_mb < least:
            raise SlurmRequestError(
                f"slurm.mem_mb ({request.mem_mb}) is too little for {request.gpus_per_node} GPU "
                "processes per node: each needs at least "
                f"{memory_request.MIN_GPU_PROCESS_MB} MB of host memory; set slurm.mem_mb to "
                f"{least} or more (or null: {memory_request.GPU_PROCESS_MB} per GPU)"
            )
        if request.min_nodes > spec.launch.nnodes:
            raise SlurmRequestError(
                f"slurm.min_nodes ({request.min_nodes}) is more than launch.nnodes "
                f"({spec.launch.nnodes}): the fewest nodes to go on with cannot exceed the "
                "nodes trained on; lower it, or set it to null"
            )
        if request.signal_seconds >= request.runtime * 60:
            raise SlurmRequestError(
                f"slurm.signal_seconds ({request.signal_seconds}) must be shorter than "
                f"slurm.runtime ({request.runtime} min = {request.runtime * 60} s): the warning "
                "would come before training starts; lower signal_seconds or raise runtime"
            )
        return request

    @property
    def nodes(self) -> int:
        """The nodes a training step runs on: launch.nnodes, fewer after a node failure."""
        return self.step_nodes or self.launch.nnodes

    @property
    def allocated_nodes(self) -> int:
        """The nodes the job asks for: launch.nnodes and slurm.spare_nodes."""
        return self.launch.nnodes + self.slurm.spare_nodes

    @property
    def min_nodes(self) -> int:
        """The fewest nodes a step may go on with in the job (``slurm.min_nodes``)."""
        return self.slurm.min_nodes or self.launch.nnodes

    @property
    def survives_node_failure(self) -> bool:
        """Does a node failure leave the job running (``--no-kill``), its next step on the
        nodes left: spare nodes held, or a smaller world allowed?"""
        return self.slurm.spare_nodes > 0 or self.min_nodes < self.launch.nnodes

    def step_hosts(
        self, hosts: list[str], exclude: Collection[str] = (), batch: str | None = None
    ) -> list[str]:
        """The nodes of a step among the job's ``hosts`` (bad or lost ones in ``exclude``), in
        the job's order: launch.nnodes healthy ones, else all of them if at least
        slurm.min_nodes; raise SlurmRequestError when fewer are left.

        The ``batch`` node (None: the job's first), where its batch script and the launcher
        run, is taken last: a spare while one is left. Its loss ends the job whatever
        ``--no-kill`` says, so the nodes whose loss the job survives are the ones that train
        (with ``launch.nnodes: 1`` and a spare, the only way the spare can ever take over).
        Not with ``slurm.rendezvous_host`` set: that names the job's first node
        (:meth:`check_rendezvous_host`), which then trains."""
        healthy = [h for h in hosts if h not in exclude]
        if len(healthy) >= self.launch.nnodes:
            batch = None if self.rendezvous_host else batch or next(iter(hosts), None)
            chosen = [h for h in healthy if h != batch] + [h for h in healthy if h == batch]
            return [h for h in healthy if h in chosen[: self.launch.nnodes]]
        if len(healthy) >= self.min_nodes:
            return healthy
        raise SlurmRequestError(
            f"{len(healthy)} healthy node(s) left in the job ({', '.join(healthy) or 'none'}; "
            f"bad: {', '.join(sorted(set(exclude) & set(hosts))) or 'none'}), fewer than "
            f"slurm.min_nodes ({self.min_nodes}) and launch.nnodes ({self.launch.nnodes})"
        )

    def on_nodes(self, count: int) -> Request:
        """This request for a step of ``count`` nodes (a smaller world, ``slurm.min_nodes``)."""
        return replace(self, step_nodes=None if count == self.launch.nnodes else count)

    @property
    def procs_per_node(self) -> int:
        return self.launch.nproc_per_node

    @property
    def cpus_per_proc(self) -> int | None:
        """None: the node's CPUs shared out (locally), 1 on SLURM."""
        return self.launch.cpus_per_proc

    @property
    def mem_mb(self) -> int:
        """``slurm.mem_mb``, or what the node's processes are estimated to need
        (:func:`memory_request.estimated_mb`; a GPU process's with :attr:`pinned_mb`)."""
        return self.slurm.mem_mb or memory_request.estimated_mb(
            self.procs_per_node, bool(self.gpus_per_node), self.pinned_mb
        )

    def estimates(self, history: list[Attempt]) -> bool:
        """Is the node's memory an estimate (``slurm.mem_mb`` null, no slot of ``history``
        measured a peak), and of GPU processes, whose checkpoints pin host memory?"""
        peak = memory_request.measured_peak_mb(history, self.procs_per_node)
        return bool(self.gpus_per_node) and not self.slurm.mem_mb and peak is None

    def measured_mem_mb(self, history: list[Attempt]) -> int:
        """:attr:`mem_mb`, but from the peak the run's last slot measured (``history``: its
        attempts) where ``slurm.mem_mb`` is null and one did (:mod:`.memory_request`)."""
        peak = memory_request.measured_peak_mb(history, self.procs_per_node)
        if self.slurm.mem_mb or peak is None:
            return self.mem_mb
        return max(self.least_mem_mb, memory_request.from_peak_mb(peak))

    def fitted_mem_mb(self, mem_mb: int, per_node: int = 1, nodes: int | None = None) -> int:
        """A node's ``--mem`` for ``per_node`` slots of ``mem_mb`` each, on ``nodes`` nodes (None:
        the job's), fitted to what the partition's nodes have
        (:func:`memory_request.node_request_mb`, sinfo read once): ddppipe's own figure capped,
        ``slurm.mem_mb`` above it refused."""
        node_mb = sinfo.memory_mb(sinfo.node_memory(self.partition), nodes or self.allocated_nodes)
        return memory_request.node_request_mb(
            mem_mb, bool(self.slurm.mem_mb), node_mb, per_node, self.least_mem_mb
        )

    @property
    def least_mem_mb(self) -> int:
        """The least a node's request may be: what its GPU processes need at least."""
        return self.gpus_per_node * memory_request.MIN_GPU_PROCESS_MB

    @property
    def runtime(self) -> int:
        return self.slurm.runtime

    @property
    def partition(self) -> str | None:
        return self.slurm.partition

    @property
    def signal_seconds(self) -> int:
        return self.slurm.signal_seconds

    @property
    def stop_signal(self) -> str:
        """The time-limit warning's signal name, e.g. SIGUSR1."""
        return self.slurm.stop_signal

    @property
    def rendezvous_host(self) -> str | None:
        return self.slurm.rendezvous_host

    def check_rendezvous_host(self, hosts: list[str]) -> None:
        """Raise SlurmRequestError when ``slurm.rendezvous_host`` is none of the job's nodes
        ``hosts``.

        (Names that do not resolve here are left to each node's agent, which names its node:
        :mod:`ddppipe.parallel.node_check`.)
        """
        host = self.rendezvous_host
        if not host or host in hosts:
            return
        try:
            wanted = _addresses(host)
            nodes = {node: _addresses(node) for node in hosts}
        except OSError:
            return
        if not any(wanted & addrs for addrs in nodes.values()):
            raise SlurmRequestError(
                f"slurm.rendezvous_host {host!r} ({', '.join(sorted(wanted))}) is none of this "
                f"job's nodes ({', '.join(hosts)}): torchrun would wait for it until its join "
                "timeout. Set it to a name of the job's first node (e.g. its InfiniBand name) "
                "or to null"
            )

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    @property
    def cpus_per_node(self) -> int:
        """CPUs the job asks for on each node (its one task's ``--cpus-per-task``)."""
        return self.procs_per_node * (self.cpus_per_proc or 1)

    def threads(self, cpus: int) -> int:
        """CPU threads of each training process on a node where ``cpus`` CPUs are usable."""
        return self.cpus_per_proc or max(1, cpus // self.procs_per_node)

    def node_threads(self, cpus: int) -> int:
        """CPU threads of a node's training processes together, ``cpus`` CPUs being usable."""
        return self.procs_per_node * self.threads(cpus)

    def resources(self) -> dict[str, Any]:
        """The train rule's resources for snakemake-executor-plugin-slurm (2.x).

        ``mpi: 0``: the key's presence makes the plugin's jobstep run the rule in the batch
        step, not inside ``srun -n1 snakemake``, so the training's own srun step is the only
        step a signal to the job's steps (``scancel --signal=USR1``) reaches, for one node as
        for many. Its false value keeps the submit side's plain request (``--ntasks``), which
        allows one task where the MPI branch insists on more than one. The time-limit warning
        is the launcher's own (:mod:`ddppipe.launching.lifecycle`), not ``--signal``.
        ``--requeue`` comes from the profile (``slurm-requeue``), so the plugin knows.
        """
        extra = "--ntasks-per-node=1" + (" --no-kill" if self.survives_node_failure else "")
        res: dict[str, Any] = {
            "nodes": self.allocated_nodes,
            "tasks": self.allocated_nodes,
            "mpi": 0,
            "cpus_per_task": self.cpus_per_node,
            "mem_mb": self.mem_mb,
            "runtime": self.runtime,
            "slurm_partition": self.partition,
            "slurm_account": self.slurm.account,
            "constraint": self.slurm.constraint,
            "qos": self.slurm.qos,
            "slurm_extra": extra,
        }
        if self.gpus_per_node:
            res.update(gres=f"gpu:{self.gpus_per_node}", tasks_per_gpu=0)
        return {k: v for k, v in res.items() if v is not None}

    def srun(
        self, job_id: str, kill_on_bad_exit: bool = True, placement: Placement | None = None,
        nodelist: list[str] | None = None,
    ) -> list[str]:  # fmt: skip
        """``srun`` of one task per node of the job, each with its node's CPUs (and GPUs);
        with ``placement``, on its nodes of the allocation, beside the steps there.

        A job that survives a node failure (:attr:`survives_node_failure`) runs each step on
        ``nodelist`` (its chosen nodes of the job), asks SLURM not to end it for a node's
        failure (``--no-kill``: sbatch's does not reach a step) and shares the nodes' CPUs
        with a step of a failed node that SLURM still counts (``--overlap``)."""
        command = [
            "srun",
            f"--jobid={job_id}",
            f"--nodes={self.nodes}",
            f"--ntasks={self.nodes}",
            "--ntasks-per-node=1",
            f"--cpus-per-task={self.cpus_per_node}",
            f"--kill-on-bad-exit={int(kill_on_bad_exit)}",
            "--export=ALL",
        ]
        if placement is not None:
            return [*command, *placement.srun_options()]  # its GPUs: the agents narrow them
        if self.survives_node_failure and nodelist:
            command += ["--no-kill", f"--nodelist={','.join(nodelist)}", "--overlap"]
        if self.gpus_per_node:
            command.append(f"--gres=gpu:{self.gpus_per_node}")
        return command

    def torchrun_args(
        self,
        job_id: str,
        max_restarts: int | None = None,
        join_timeout_s: int | None = None,
    ) -> list[str]:
        """torchrun options in job ``job_id``: a c10d rendezvous across its nodes, its join
        timeout ``join_timeout_s`` (None: for its nodes) and its keep-alive interval for its
        nodes (:mod:`ddppipe.parallel.startup_limits`).

        The rendezvous endpoint is ``slurm.rendezvous_host`` when set; otherwise ``ddppipe
        agent`` takes the first node of its own step (:func:`step_rendezvous`).
        """
        restarts = self.launch.max_restarts if max_restarts is None else max_restarts
        join = join_timeout_s or startup_limits.join_timeout_s(self.nodes)
        common = [f"--nnodes={self.nodes}", f"--nproc-per-node={self.procs_per_node}"]
        endpoint = (
            [f"--rdzv-endpoint={self.rendezvous_host}:{job_port(int(job_id))}"]
            if self.rendezvous_host
            else []
        )
        return [
            *common,
            "--rdzv-backend=c10d",
            *endpoint,
            f"--rdzv-id={job_id}",
            f"--rdzv-conf=join_timeout={join},"
            f"keep_alive_interval={startup_limits.keep_alive_s(self.nodes)}",
            f"--max-restarts={restarts}",
        ]


def step_rendezvous(env: dict[str, str] | os._Environ) -> str:
    """``host:port`` of a step's rendezvous: its first node, the port from its job and step."""
    nodelist = step_nodelist(env)
    job = job_id(dict(env))
    if not nodelist or not job:
        raise SlurmRequestError(
            "no SLURM step here (SLURM_STEP_NODELIST / SLURM_JOB_ID unset): give torchrun "
            "--rdzv-endpoint, or set slurm.rendezvous_host"
        )
    step = env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID") or "0"
    return f"{first_host(nodelist)}:{step_port(int(job), int(step) if step.isdigit() else 0)}"


def train_resources(runs: Runs, on_slurm: bool = False) -> dict[str, Callable[[Any], Any]]:
    """The train rule's resources, each a function of the job's ``run`` wildcard.

    A scaling-study point or a sweep's trial asks for its own nodes, CPUs, time, ...
    (:meth:`ddppipe.settings.runs.Runs.spec`, the run resolved once). The base run's request is
    checked here, so a bad one fails when the Snakefile is read. With ``slurm.mem_mb`` null, a
    run whose earlier slot measured its memory (``results/<run>/state``) asks for that peak
    with a margin (:meth:`Request.measured_mem_mb`). ``on_slurm``: the memory fits the
    partition's nodes (:meth:`Request.fitted_mem_mb`), and a GPU run's first estimate counts
    what its checkpoints pin (:func:`pinned_mb`).
    """

    def request(run: str) -> dict[str, Any]:
        spec = runs.spec(run)
        request = Request.from_spec(spec)
        history = attempts.read(StateDir(layout.RunLayout(run).state).attempts)
        if on_slurm and request.estimates(history):
            request = replace(request, pinned_mb=pinned_mb(spec))
        mem_mb = request.measured_mem_mb(history)
        if on_slurm:
            mem_mb = request.fitted_mem_mb(mem_mb)
        return {**request.resources(), "mem_mb": mem_mb}

    by_run = {runs.base["run"]: request(runs.base["run"])}

    def of_run(run: str) -> dict[str, Any]:
        if run not in by_run:
            by_run[run] = request(run)
        return by_run[run]

    return {key: lambda wildcards, key=key: of_run(wildcards.run).get(key) for key in RESOURCE_KEYS}


def pinned_mb(spec: RunSpec) -> int:
    """MB each GPU process of the run pins on the host for its checkpoints
    (:func:`memory_request.pinned_mb`: its model's and optimizer's size), the model's
    parameters counted on the meta device where the Snakefile is read: the task imported
    there once, before the run's first slot only. 0 where that cannot say: a script's model, a
    task whose model cannot be built on the meta device, no torch there (said)."""
    if spec.kind == "script":
        return 0
    try:
        task = tasks.load(spec.task, step="the train rule's memory request")
        args = tasks.validate_args(task, run_spec.plain(spec.task_args))
        count = tasks.parameter_count(task, args)
    except (UserError, ImportError) as e:
        log.warning("%s: the first memory request counts no checkpoint copy of the model (%s); "
                    "set slurm.mem_mb if it is large", spec.run, e)  # fmt: skip
        return 0
    shards = {"fsdp": spec.world_size, "hsdp": spec.launch.nproc_per_node}
    return memory_request.pinned_mb(count, spec.train.optimizer,
                                    shards.get(spec.launch.strategy, 1))  # fmt: skip


def _addresses(host: str) -> set[str]:
    return {info[4][0] for info in socket.getaddrinfo(host, None)}
