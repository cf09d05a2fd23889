"""From a config to the processes that train: torchrun agents, locally or as a SLURM step.

Where the launcher runs decides how: inside a SLURM allocation (``SLURM_JOB_ID`` set) the
training is one srun step over the job's nodes, whatever their number; outside one it is a
local ``torchrun --standalone``. Both start ``ddppipe agent`` (torchrun that survives SIGUSR1).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from ddppipe import config, container, preemption, slurm

log = logging.getLogger(__name__)


def available_cpus() -> int:
    """CPUs this process may use (SLURM's allocation on this node, or the affinity mask)."""
    if "SLURM_CPUS_ON_NODE" in os.environ:
        return int(os.environ["SLURM_CPUS_ON_NODE"])
    return len(os.sched_getaffinity(0))


def job_threads(cfg: dict[str, Any]) -> int:
    """CPU threads a local training job uses: its processes times their threads.

    The train rule's ``threads``, so Snakemake does not run two trainings on the same cores.
    """
    request = slurm.Request.from_config(cfg)
    return request.procs_per_node * request.threads(available_cpus())


def thread_environment(threads: int, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (this environment) with ``threads`` CPU threads per launched process.

    MKL's count too: torch lets MKL_NUM_THREADS override OMP_NUM_THREADS, and Snakemake
    exports MKL_NUM_THREADS = the job's threads, which made 2 ranks run 2 threads each on
    2 CPUs (half the images/s; MKL's thread count also changes the numerics).
    """
    env = os.environ if env is None else env
    return {**env, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


@dataclass(frozen=True)
class Plan:
    """What to run for a config where this process is: command, environment, job, hosts."""

    command: list[str]
    env: dict[str, str]
    job: str | None  # the SLURM job, None for a local run
    hosts: list[str]
    request: slurm.Request


def plan(
    cfg: dict[str, Any],
    module_args: list[str],
    env: Mapping[str, str] | None = None,
    hosts: list[str] | None = None,
    max_restarts: int | None = None,
    join_timeout_s: int = slurm.RDZV_JOIN_TIMEOUT_S,
) -> Plan:
    """``ddppipe agent`` running ``python -m ddppipe MODULE_ARGS`` on every node of the run.

    ``hosts`` are the job's nodes (looked up with scontrol when not given).
    """
    env = dict(os.environ if env is None else env)
    request = slurm.Request.from_config(cfg)
    job = slurm.job_id(env)
    gpus = bool(request.gpus_per_node)
    agent = ["-m", "ddppipe", "agent"]
    if job is None:
        if request.nodes > 1:
            raise config.ConfigError(
                f"launch.nnodes is {request.nodes}, but this is no SLURM allocation: run "
                "`snakemake --profile profiles/slurm` (or set launch.nnodes: 1 for a local run)"
            )
        command = [
            *container.python_command(cfg, gpus or None), *agent,
            *request.torchrun_args(max_restarts=max_restarts), "-m", "ddppipe", *module_args,
        ]  # fmt: skip
        env = thread_environment(request.threads(available_cpus()), env)
        return Plan(command, env, None, [socket.gethostname()], request)
    hosts = hosts or slurm.job_nodes(job)
    if len(hosts) != request.nodes:
        raise slurm.SlurmRequestError(
            f"SLURM job {job} has {len(hosts)} node(s) ({','.join(hosts)}) but launch.nnodes is "
            f"{request.nodes}: run it in a job of that many nodes (the SLURM profile asks for them)"
        )
    command = [
        *request.srun(job), *container.python_command(cfg, gpus), *agent,
        *request.torchrun_args(job, hosts, max_restarts, join_timeout_s),
        "-m", "ddppipe", *module_args,
    ]  # fmt: skip
    threads = request.threads(request.cpus_per_node)
    return Plan(command, thread_environment(threads, env), job, hosts, request)


def train_args(config: Path, data: Path, state: Path, checkpoint: Path, metrics: Path) -> list[str]:
    return [
        f"--config={config}",
        f"--data={data}",
        f"--state={state}",
        f"--checkpoint={checkpoint}",
        f"--metrics={metrics}",
    ]


# -- supervising the agent or the srun step -------------------------------------------------

# Signals the launcher passes on to the torchrun agent or srun it started.
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent() -> None:
    """(In the child, before exec) Get SIGTERM when the launcher dies, even of SIGKILL."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def supervise(command: list[str], env: dict[str, str], state_dir: Path) -> tuple[int, dict | None]:
    """Run ``command`` (torchrun or srun), passing signals on; its exit status and stop note.

    The child runs in its own session, so a signal to the launcher's process group reaches
    it once, through the launcher; if the launcher is killed outright, the child gets
    SIGTERM. The note is :func:`ddppipe.preemption.record`'s, left when training stopped on
    a signal after writing a checkpoint (None otherwise), whatever exit status srun made of
    the ranks' exits.
    """
    preemption.take(state_dir)  # a note left by an earlier run is not this run's
    sys.stdout.flush()
    sys.stderr.flush()
    child = subprocess.Popen(command, env=env, start_new_session=True, preexec_fn=_die_with_parent)

    def forward(signum: int, frame: FrameType | None) -> None:
        if child.poll() is None:
            child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    try:
        code = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    note = preemption.take(state_dir)
    return (code if code >= 0 else 128 - code), (note if code != 0 else None)


def run_agent(torchrun_argv: list[str]) -> int:
    """torchrun in this process, surviving SIGUSR1, passing a worker's exit 75 on.

    SLURM signals every process of the step; torchrun's agent would die of SIGUSR1 (its
    default action). Ignoring it here is inherited by the workers until the training
    loop installs its own handler (ddppipe.preemption), so no process dies of it.
    The launcher decides the run's exit status; 75 here is for srun's log.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        torchrun_main(torchrun_argv)
    except ChildFailedError as e:
        codes = {f.exitcode for f in e.failures.values()}
        print(f"{e}\nddppipe agent: workers exited {sorted(codes)}", file=sys.stderr)
        return preemption.EXIT_CODE if preemption.EXIT_CODE in codes else 1
    return 0
