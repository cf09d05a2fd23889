"""From a config to the processes that train: a local worker group, or a SLURM step.

Where the launcher runs decides how: inside a SLURM allocation (``SLURM_JOB_ID`` set) the
training is one srun step over the job's nodes, whatever their number, each node's
processes started by ``ddppipe agent`` (torchrun that survives SIGUSR1, for its rendezvous
across nodes); outside one the launcher starts the processes itself
(:mod:`ddppipe.launching.workers`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

from ddppipe.core import slot, system
from ddppipe.launching import node_watch, slot_machine, watchdog, workers
from ddppipe.parallel import node_check
from ddppipe.runstate import finished_nodes, node_beats, preemption
from ddppipe.runstate.state import StateDir
from ddppipe.settings import config, run_spec
from ddppipe.settings.run_spec import RunSpec
from ddppipe.slurm import request as slurm_request
from ddppipe.slurm import scontrol
from ddppipe.slurm.placement import Placement

log = logging.getLogger(__name__)


def job_threads(spec: run_spec.RunSpec) -> int:
    """CPU threads a local training job uses: its processes times their threads.

    The train rule's ``threads``, so Snakemake does not run two trainings on the same cores.
    """
    return slurm_request.Request.from_spec(spec).node_threads(system.available_cpus())


GLOO_LAZY = "TORCH_GLOO_LAZY_INIT"  # torch's switch for gloo's connections made at first use


def process_environment(threads: int, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (this environment) for a launched process: ``threads`` CPU threads, and gloo's
    connections made lazily.

    MKL's count too: torch lets MKL_NUM_THREADS override OMP_NUM_THREADS, and Snakemake
    exports MKL_NUM_THREADS = the job's threads, which made 2 ranks run 2 threads each on
    2 CPUs (half the images/s; MKL's thread count also changes the numerics).

    Gloo otherwise connects every rank of a group to every other as the group is made (a
    full mesh: N - 1 connections a rank, N² in all, for each of the world-wide gloo groups,
    the training's on CPUs and the checkpoints' own); lazily each pair connects at its first
    use, so a ring's collectives connect a rank to its 2 neighbours and a gather to rank 0
    connects rank 0 to each rank (gloo#419). A value the user set is kept.
    """
    env = os.environ if env is None else env
    return {GLOO_LAZY: "1", **env, "OMP_NUM_THREADS": str(threads),
            "MKL_NUM_THREADS": str(threads)}  # fmt: skip


@dataclass(frozen=True)
class Plan:
    """What to run for a config where this process is: command, environment, job, hosts."""

    command: list[str]  # the srun step in a SLURM job; locally, each worker's command
    env: dict[str, str]
    job: str | None  # the SLURM job, None for a local run
    hosts: list[str]
    request: slurm_request.Request
    placement: Placement | None = None  # a packed multi-node trial's nodes of its allocation

    @property
    def own_job(self) -> bool:
        """Whether it runs in a SLURM job of its own (not a packed trial's allocation, whose
        workers check its nodes, warn it of the end and take it back when it stops)."""
        return self.job is not None and self.placement is None

    @property
    def workers(self) -> int:
        """Processes the launcher starts with ``command``: the local ranks, or one srun."""
        return self.request.procs_per_node if self.job is None else 1

    def slot_state(self) -> slot_machine.SlotState:
        """The slot machine's state of a step of this plan, as it starts."""
        request = self.request
        return slot_machine.SlotState(
            self.job, self.own_job, tuple(self.hosts), request.survives_node_failure,
            request.stop_signal, request.signal_seconds, request.slurm.max_continuations,
            request.slurm.max_excluded_nodes,
        )  # fmt: skip


def plan(
    spec: RunSpec,
    module_args: list[str],
    python: Sequence[str],
    env: Mapping[str, str] | None = None,
    hosts: list[str] | None = None,
    max_restarts: int | None = None,
    join_timeout_s: int | None = None,
    program: list[str] | None = None,
    exclude: Collection[str] = (),
) -> Plan:
    """``python -m ddppipe MODULE_ARGS`` on every rank of the run: locally the command of
    each worker, in a SLURM job an srun step of ``ddppipe agent`` on every node.

    ``python``: the run's Python (:func:`~ddppipe.apptainer.running.python_command`);
    ``program`` (a script and its arguments) replaces ``-m ddppipe MODULE_ARGS``.
    ``hosts`` are the job's nodes (looked up with scontrol when not given); a placed step
    (a packed sweep's multi-node trial, :mod:`ddppipe.slurm.placement`) runs on its own. In a
    job that survives a node failure (``slurm.spare_nodes``, ``slurm.min_nodes``) the step
    runs on launch.nnodes of the job's nodes but those in ``exclude`` (bad, lost), its first
    node a spare while another is left, on fewer down to slurm.min_nodes
    (:meth:`~ddppipe.slurm.request.Request.step_hosts`).
    """
    program = program or ["-m", "ddppipe", *module_args]
    env = dict(os.environ if env is None else env)
    request = slurm_request.Request.from_spec(spec)
    job = scontrol.job_id(env)
    agent = ["-m", "ddppipe", "agent"]
    if job is None:
        if request.nodes > 1:
            raise config.ConfigError(
                f"launch.nnodes is {request.nodes}, but this is no SLURM allocation: run "
                "`snakemake --profile profiles/slurm` (or set launch.nnodes: 1 for a local run)"
            )
        command = [*python, *program]
        env = process_environment(request.threads(system.available_cpus()), env)
        return Plan(command, env, None, [socket.gethostname()], request)
    placement = Placement.from_env(env)
    hosts = hosts or (placement.nodes if placement else scontrol.job_nodes(job))
    if placement is None and request.survives_node_failure:
        hosts = request.step_hosts(hosts, exclude, env.get(node_beats.NODE_ENV))  # (its node)
        request = request.on_nodes(len(hosts))
    if len(hosts) < request.nodes:
        raise slurm_request.SlurmRequestError(
            f"SLURM job {job} has {len(hosts)} node(s) ({','.join(hosts)}) but launch.nnodes is "
            f"{request.nodes}: run it in a job of that many nodes (the SLURM profile asks for them)"
        )
    request.check_rendezvous_host(hosts)
    command = [
        *request.srun(job, placement=placement, nodelist=hosts), *python, *agent,
        *request.torchrun_args(job, max_restarts, join_timeout_s), *program,
    ]  # fmt: skip
    threads = request.threads(request.cpus_per_node)
    return Plan(command, process_environment(threads, env), job, hosts, request, placement)


# -- supervising the agent or the srun step -------------------------------------------------

# Signals the launcher passes on to the torchrun agent or srun it started.
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
PR_SET_PDEATHSIG = 1  # linux/prctl.h
LOST_STEP_WAIT_S = 3.0  # srun waits for a lost node's tasks: killed after this


def _die_with_parent() -> None:
    """(In the child, before exec) Get SIGTERM when the launcher dies, even of SIGKILL."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def _start_rank() -> None:
    """(In a local rank, before exec) :func:`_die_with_parent`, and ignore the stop signals
    until the rank's own handler takes them (ddppipe.runstate.preemption.Guard), as a rank
    forked warm does: a warning due as the slot starts must not kill a rank still starting (it
    stops by the clock instead, its slot record's ``stop_at``)."""
    _die_with_parent()
    for sig in (signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)


@dataclass(frozen=True)
class Ended:
    """How a slot's processes ended (:func:`supervise`): their exit status, the stop note, and
    the problems their nodes' checks named (``preflight: NODE: ...`` lines of an srun step)."""

    code: int
    note: dict | None
    checks: list[str] = field(default_factory=list)


def supervise(
    plan: Plan, env: dict[str, str], record: slot.Slot, warn_in: float | None = None,
    watch: watchdog.Watchdog | None = None,
) -> Ended:  # fmt: skip
    """Run ``plan`` (the local workers or the srun step), passing signals on; how it ended.
    Every process of it reads ``record`` (the slot record, written first into the state
    folder, its ``launcher`` this process). ``warn_in``: seconds until the stop signal
    (``slurm.stop_signal``), the time-limit warning (srun passes it on to its tasks only);
    ``watch`` watches the ranks' progress; in a job that survives a node failure a node watch
    (:mod:`ddppipe.launching.node_watch`) watches its nodes (:func:`_drain`).

    The child runs in its own session, so a signal to the launcher's process group reaches
    it once, through the launcher; if the launcher is killed outright, the child gets
    SIGTERM. An srun step's stderr passes through this process, which keeps the lines of its
    nodes' failed checks (:mod:`ddppipe.parallel.node_check`). The note: :func:`_stop_note`.
    """
    state = StateDir(Path(record.state))
    preemption.take(state)  # a note left by an earlier run is not this run's
    # whose training a note or mark is; a slot of its own (a job goes on after a lost node)
    attempt = f"{env.get('SLURM_JOB_ID') or 'local'}:{socket.gethostname()}:{os.getpid()}"
    attempt += f"/{record.attempt}"
    record = replace(record, launcher=attempt)
    env = {**env, **slot.write(record, state.slot)}
    if plan.job is not None:
        finished_nodes.prepare(state)
    if watch is not None:
        env.update(watch.environment())
    nodes = None
    if plan.own_job and plan.request.survives_node_failure:
        records = watch.records if watch is not None else None  # (one reader of both)
        nodes = node_watch.NodeWatch(state, str(plan.job), plan.hosts, records)
    sys.stdout.flush()
    sys.stderr.flush()
    child = _start(plan, env)
    checks: list[str] = []
    reader = None
    if isinstance(child, subprocess.Popen) and child.stderr is not None:
        reader = threading.Thread(target=_pass_on, args=(child.stderr, checks), daemon=True)
        reader.start()
    code = _drain(child, plan, plan.slot_state(), warn_in, watch, nodes, attempt)
    if reader is not None:
        reader.join(timeout=STDERR_DRAIN_S)
    return Ended(code, _stop_note(state, attempt, code, plan, watch, nodes), checks)


STDERR_DRAIN_S = 5  # after srun exits: the rest of its stderr (a task's child may keep it open)


def _pass_on(stream: IO[bytes], checks: list[str]) -> None:
    """Copy ``stream`` (srun's stderr) to this process's stderr line by line, keeping the
    lines of failed node checks in ``checks``."""
    prefix = node_check.PREFIX.encode()
    for line in stream:
        written = 0
        while written < len(line):  # (a pipe takes a long line in parts)
            written += os.write(2, line[written:])
        if line.startswith(prefix):
            checks.append(line.decode(errors="replace").rstrip("\n"))


def _start(plan: Plan, env: dict[str, str]) -> workers.Group | subprocess.Popen:
    """The local worker group, or the srun step in a session of its own (its stderr through
    this process: :func:`_pass_on`)."""
    if plan.job is None:
        return workers.Group(
            plan.command, env, plan.workers, plan.request.launch.max_restarts, _start_rank
        )
    return subprocess.Popen(
        plan.command, env=env, start_new_session=True, preexec_fn=_die_with_parent,
        stderr=subprocess.PIPE,
    )  # fmt: skip


def _drain(
    child: workers.Group | subprocess.Popen, plan: Plan, slot: slot_machine.SlotState,
    warn_in: float | None, watch: watchdog.Watchdog | None,
    nodes: node_watch.NodeWatch | None, attempt: str,
) -> int:  # fmt: skip
    """``child``'s exit status. Meanwhile the slot's events (the warning after ``warn_in``
    seconds, the launcher's signals, ``watch``'s hang, ``nodes``' lost node) go through one
    queue, drained here alone: :func:`~ddppipe.launching.slot_machine.step` decides, and
    :func:`_act` acts."""
    events: queue.SimpleQueue = queue.SimpleQueue()  # (its put is safe in a signal handler)
    waiter = threading.Thread(target=lambda: events.put(workers.exit_status(child.wait())),
                              name="ddppipe-step-wait", daemon=True)  # fmt: skip
    timer = None if warn_in is None else threading.Timer(warn_in, events.put,
                                                         (slot_machine.Warned(),))  # fmt: skip
    previous = {sig: signal.signal(sig, lambda signum, _: events.put(
        slot_machine.Signalled(signum))) for sig in FORWARDED}  # fmt: skip
    try:
        if timer:
            timer.daemon = True
            timer.start()
        if watch is not None:
            watch.start(lambda beats: events.put(slot_machine.Hung(tuple(beats))),
                        lambda: _pids(child))  # fmt: skip
        if nodes is not None:
            nodes.start(attempt, lambda: events.put(slot_machine.NodeLost()))
        waiter.start()
        while not isinstance(event := events.get(), int):
            slot, actions = slot_machine.step(slot, event)
            for action in actions:
                _act(action, child, plan, watch, nodes)
        return event
    finally:
        if watch is not None:
            watch.stop()
        if nodes is not None:
            nodes.stop()
        if timer:
            timer.cancel()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _act(
    action: slot_machine.Action, child: workers.Group | subprocess.Popen, plan: Plan,
    watch: watchdog.Watchdog | None, nodes: node_watch.NodeWatch | None,
) -> None:  # fmt: skip
    """Carry out ``action`` while the step runs: the one place it is signalled or killed."""
    if isinstance(action, slot_machine.Say):
        log.log(action.level, "%s", action.text)
    elif isinstance(action, slot_machine.Forward):
        if child.poll() is None:
            child.send_signal(action.signum)
    elif isinstance(action, slot_machine.EndStep) and action.why == "hung":
        _end_hung(child, plan, list(action.beats))
    elif isinstance(action, slot_machine.EndStep) and nodes is not None:
        _end_step(child, plan, nodes, watch)


def _stop_note(
    state: StateDir, attempt: str, code: int, plan: Plan, watch: watchdog.Watchdog | None,
    nodes: node_watch.NodeWatch | None = None,
) -> dict | None:  # fmt: skip
    """What stopped the step (:func:`supervise`), for the slot machine to order
    (:data:`~ddppipe.launching.slot_machine.CAUSES`); None when the training just ended: the
    ranks' stop note (:func:`ddppipe.runstate.preemption.record`: a signal and the checkpoint
    after it; another launcher's is ignored), a hang (``hung``:
    :meth:`ddppipe.launching.watchdog.Hang.as_dict`), the nodes lost (``lost``, how:
    ``detail``) or those without a finished mark after srun exited 0 (``unfinished``:
    :mod:`ddppipe.runstate.finished_nodes`)."""
    note = preemption.take(state)
    if note is not None and note.get("attempt") != attempt:
        log.warning("ignored the stop note of another training: %s", note)
        note = None
    found: dict[str, Any] = {}
    if note is None and code == 0 and plan.job is not None:
        done = finished_nodes.finished(state, attempt)
        if len(done) < plan.request.nodes:
            found["unfinished"] = sorted(set(plan.hosts) - done)
            log.warning("srun exited 0, but no finished mark came from %s",
                        ", ".join(found["unfinished"]))  # fmt: skip
    if watch is not None and watch.hang is not None:
        found["hung"] = watch.hang.as_dict()
    base = {"signal": None, "checkpoint": None, "attempt": attempt}
    note = {**(note or base), **found} if note or found else None
    if nodes is None:
        return note
    if slot_machine.may_be_lost(code, note, bool(nodes.lost)) and nodes.check(ask_slurm=True):
        note = {**(note or base), "lost": nodes.lost, "detail": nodes.why}
    elif nodes.lost:
        log.warning("node(s) %s lost after every rank finished: the slot stays finished (%s)",
                    ", ".join(nodes.lost), nodes.why)  # fmt: skip
    return note


def _pids(child: workers.Group | subprocess.Popen) -> list[int]:
    """The local ranks' processes (none for an srun step: its ranks are the step's)."""
    return [p.pid for p in child.procs] if isinstance(child, workers.Group) else []


def _end_hung(child: workers.Group | subprocess.Popen, plan: Plan, beats: list) -> None:
    """(The watchdog, on a hang, after the stacks) Kill the ranks: locally the worker group,
    on SLURM the srun step on every node (SIGKILL to the job would reach the batch script)."""
    if plan.job is None:
        child.send_signal(signal.SIGKILL)
        return
    for step in watchdog.steps(plan.job, beats):
        watchdog.scancel(step, signal.SIGKILL)
    _wait_or_kill(child, watchdog.KILL_WAIT_S)


def _end_step(
    child: workers.Group | subprocess.Popen, plan: Plan, nodes: node_watch.NodeWatch,
    watch: watchdog.Watchdog | None,
) -> None:  # fmt: skip
    """(The node watch, a node lost) End the step: its ranks on the nodes left killed, unless
    their agents all exited (their ranks failed on the lost peer), then srun, which would wait
    for the lost node's tasks until SLURM declares the node down. The step is the one the
    ranks' heartbeats name (squeue's without them: it may not answer while a node is lost)."""
    if not nodes.others_ended():
        for step in watchdog.steps(str(plan.job), watch.beats() if watch is not None else []):
            watchdog.scancel(step, signal.SIGKILL)
        _wait_or_kill(child, LOST_STEP_WAIT_S)
    elif child.poll() is None:
        child.kill()


def _wait_or_kill(child: workers.Group | subprocess.Popen, seconds: float) -> None:
    """Give srun ``seconds`` to exit after its step was killed, then kill it."""
    deadline = time.monotonic() + seconds
    while child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    if child.poll() is None:
        log.warning("srun still runs %.0f s after its step was killed: killing srun", seconds)
        child.kill()
