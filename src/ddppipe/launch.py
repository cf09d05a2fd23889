"""From a config to the processes that train: torchrun agents, locally or under srun."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import FrameType
from typing import Any

from ddppipe import container, preemption

log = logging.getLogger(__name__)


def threads_per_proc(cfg: dict[str, Any], cpus: int) -> int:
    """CPU threads for each training process: configured, or the node's CPUs shared out."""
    configured = cfg["launch"].get("threads_per_proc")
    if configured:
        return configured
    return max(1, cpus // cfg["launch"]["nproc_per_node"])


def job_threads(cfg: dict[str, Any]) -> int:
    """CPU threads a local training job uses: its processes times their threads.

    The train rule's ``threads``, so Snakemake does not run two trainings on the same cores.
    """
    return cfg["launch"]["nproc_per_node"] * threads_per_proc(cfg, available_cpus())


def available_cpus() -> int:
    """CPUs this process may use (SLURM's allocation or the affinity mask)."""
    if "SLURM_CPUS_ON_NODE" in os.environ:
        return int(os.environ["SLURM_CPUS_ON_NODE"])
    return len(os.sched_getaffinity(0))


def local_torchrun(cfg: dict[str, Any], train_args: list[str]) -> list[str]:
    """``torchrun --standalone`` (as ``ddppipe agent``) with the configured processes.

    With ``container.mode: apptainer`` it runs inside the image (``apptainer exec IMAGE``).
    """
    launch = cfg["launch"]
    return [
        *container.python_command(cfg),
        "-m",
        "ddppipe",
        "agent",
        "--standalone",
        "--nnodes=1",
        f"--nproc-per-node={launch['nproc_per_node']}",
        f"--max-restarts={launch['max_restarts']}",
        "-m",
        "ddppipe",
        "train",
        *train_args,
    ]


def thread_environment(threads: int) -> dict[str, str]:
    """This environment with ``threads`` CPU threads per launched process.

    MKL's count too: torch lets MKL_NUM_THREADS override OMP_NUM_THREADS, and Snakemake
    exports MKL_NUM_THREADS = the job's threads, which made 2 ranks run 2 threads each on
    2 CPUs (half the images/s; MKL's thread count also changes the numerics).
    """
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def environment(cfg: dict[str, Any], cpus: int) -> dict[str, str]:
    """Environment for the launched processes (thread counts)."""
    return thread_environment(threads_per_proc(cfg, cpus))


# Signals the launcher passes on to the torchrun agent or srun it started.
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent() -> None:
    """(In the child, before exec) Get SIGTERM when the launcher dies, even of SIGKILL."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def supervise(command: list[str], env: dict[str, str], state_dir: Path) -> int:
    """Run ``command`` (torchrun or srun), passing signals on; its exit status, or 75.

    The child runs in its own session, so a signal to the launcher's process group reaches
    it once, through the launcher; if the launcher is killed outright, the child gets
    SIGTERM. If training stopped on a signal after writing a checkpoint (the note of
    :func:`ddppipe.preemption.record`), the result is :data:`~ddppipe.preemption.EXIT_CODE`
    however srun reported the ranks' exits.
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
    if note and code != 0:
        log.warning(
            "training stopped on %s after writing %s (launcher exit status %d): exiting %d "
            "so the job is retried and resumes there",
            note["signal"], note["checkpoint"], code, preemption.EXIT_CODE,
        )  # fmt: skip
        return preemption.EXIT_CODE
    return code if code >= 0 else 128 - code


def train_args(config: Path, data: Path, state: Path, checkpoint: Path, metrics: Path) -> list[str]:
    return [
        f"--config={config}",
        f"--data={data}",
        f"--state={state}",
        f"--checkpoint={checkpoint}",
        f"--metrics={metrics}",
    ]


# -- SLURM: one torchrun agent per node, started by one srun step ---------------------------

RDZV_JOIN_TIMEOUT_S = 120


def rendezvous_endpoint(cfg: dict[str, Any], job_id: str, hosts: list[str]) -> str:
    """``host:port``: the configured host or the job's first node; the port from the job id."""
    from ddppipe.environments import job_port

    host = cfg["slurm"].get("rendezvous_host") or hosts[0]
    return f"{host}:{job_port(int(job_id))}"


def srun_step(cfg: dict[str, Any], job_id: str, kill_on_bad_exit: bool = True) -> list[str]:
    """``srun`` of one task per node of the job, each with the CPUs (and GPUs) of its node."""
    launch, slurm = cfg["launch"], cfg["slurm"]
    nodes = launch["nnodes"]
    command = [
        "srun",
        f"--jobid={job_id}",
        f"--nodes={nodes}",
        f"--ntasks={nodes}",
        "--ntasks-per-node=1",
        f"--cpus-per-task={launch['nproc_per_node'] * slurm['cpus_per_task']}",
        f"--kill-on-bad-exit={int(kill_on_bad_exit)}",
        "--export=ALL",
    ]
    if slurm["gpus_per_node"]:
        command.append(f"--gres=gpu:{slurm['gpus_per_node']}")
    return command


def slurm_torchrun(
    cfg: dict[str, Any],
    job_id: str,
    hosts: list[str],
    module_args: list[str],
    max_restarts: int | None = None,
    join_timeout_s: int = RDZV_JOIN_TIMEOUT_S,
) -> list[str]:
    """srun step starting ``ddppipe agent`` (torchrun, USR1-safe) on every node of the job."""
    launch = cfg["launch"]
    restarts = launch["max_restarts"] if max_restarts is None else max_restarts
    gpus = bool(cfg["slurm"]["gpus_per_node"])
    return [
        *srun_step(cfg, job_id),
        *container.python_command(cfg, gpus),  # [apptainer exec --nv IMAGE] python
        "-m",
        "ddppipe",
        "agent",
        f"--nnodes={launch['nnodes']}",
        f"--nproc-per-node={launch['nproc_per_node']}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rendezvous_endpoint(cfg, job_id, hosts)}",
        f"--rdzv-id={job_id}",
        f"--rdzv-conf=join_timeout={join_timeout_s}",
        f"--max-restarts={restarts}",
        "-m",
        "ddppipe",
        *module_args,
    ]


def slurm_environment(cfg: dict[str, Any]) -> dict[str, str]:
    """Environment of the srun step: one thread per allocated CPU of each process."""
    launch, slurm = cfg["launch"], cfg["slurm"]
    return thread_environment(launch.get("threads_per_proc") or slurm["cpus_per_task"])


def run_agent(torchrun_argv: list[str]) -> int:
    """torchrun in this process, surviving SIGUSR1, passing a worker's exit 75 on.

    SLURM signals every process of the step; torchrun's agent would die of SIGUSR1 (its
    default action). Ignoring it here is inherited by the workers until the training
    loop installs its own handler (ddppipe.preemption), so no process dies of it.
    The launcher decides the run's exit status (:func:`supervise`); 75 here is for srun's log.
    """
    import signal

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    from ddppipe.preemption import EXIT_CODE

    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        torchrun_main(torchrun_argv)
    except ChildFailedError as e:
        codes = {f.exitcode for f in e.failures.values()}
        print(f"{e}\nddppipe agent: workers exited {sorted(codes)}", file=sys.stderr)
        return EXIT_CODE if EXIT_CODE in codes else 1
    return 0
