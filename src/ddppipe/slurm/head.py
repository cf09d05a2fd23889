"""The submitting ``snakemake`` (the head) as a small SLURM job: no login session to keep open.

``ddppipe submit [--time T] [--partition P] -- SNAKEMAKE_ARGS`` submits, from the current
directory, a 1-CPU batch job (:data:`JOB_NAME`, log ``logs/head/<job id>.log``) that runs
``ddppipe head -- SNAKEMAKE_ARGS``: ``snakemake ARGS --unlock`` (a head that died left its
lock) and then ``snakemake ARGS``, which attaches to the run's training job if one still
queues or runs (ddppipe.slurm.executor.attach). :data:`WARNING_S` before the head job's time limit
SLURM sends it SIGUSR1: it stops its snakemake (the training job goes on) and requeues itself
(same job id); its next start attaches the same way. ``submit`` refuses while a head job of
the same directory is queued or running: two heads on one directory would unlock each other.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from ddppipe.core.errors import UserError
from ddppipe.slurm import sbatch, scontrol, squeue

JOB_NAME = "ddppipe-head"
WARNING_S = 120  # SIGUSR1 to the head job this long before its time limit (SLURM: +0-60 s)
LOG = "logs/head/%j.log"


class HeadError(RuntimeError, UserError):
    """The head job cannot be submitted; the message says why and what to do."""


def sbatch_argv(
    workdir: Path, time: str, partition: str | None, account: str | None, args: Sequence[str]
) -> list[str]:
    """The ``sbatch`` command of the head job running ``snakemake args`` in ``workdir``."""
    command = [sys.executable, "-m", "ddppipe", "head", "--", *args]
    options: dict[str, sbatch.Option] = {
        "--job-name": JOB_NAME, "--chdir": str(workdir), "--output": LOG,
        "--open-mode": "append", "--time": time, "--nodes": "1", "--ntasks": "1",
        "--cpus-per-task": "1", "--mem": "2000", "--requeue": True,
        "--signal": f"B:USR1@{WARNING_S}", "--partition": partition or None,
        "--account": account or None,
    }  # fmt: skip
    return sbatch.argv(options, f"exec {shlex.join(command)}")  # exec: USR1 (B:) reaches the head


def live_heads(workdir: Path) -> list[str]:
    """This user's head jobs of ``workdir`` that are queued or running."""
    return [q.job for q in squeue.mine()
            if q.name == JOB_NAME and q.workdir.resolve() == workdir.resolve()]  # fmt: skip


def submit(
    args: Sequence[str], time: str, partition: str | None = None, account: str | None = None,
    workdir: Path | None = None,
) -> str:  # fmt: skip
    """Submit the head job; its id. HeadError when one of this directory already runs."""
    workdir = (workdir or Path.cwd()).resolve()
    if not args:
        raise HeadError("no snakemake arguments: ddppipe submit -- --profile profiles/slurm ...")
    running = live_heads(workdir)
    if running:
        raise HeadError(
            f"head job {', '.join(running)} of {workdir} is queued or running: two heads would "
            f"unlock each other (see logs/head/); scancel it first to submit another"
        )
    (workdir / LOG).parent.mkdir(parents=True, exist_ok=True)
    try:
        return sbatch.submit(sbatch_argv(workdir, time, partition, account, args), timeout=60)
    except sbatch.SbatchError as e:
        raise HeadError(f"sbatch refused the head job: {e}") from None


def run_head(args: Sequence[str]) -> int:
    """In the head job: unlock, then run snakemake with ``args``; requeue on SIGUSR1."""
    snakemake = [sys.executable, "-m", "snakemake", *args]
    # the head job's SLURM_* variables would pass into the training job's sbatch (the plugin
    # removes them with a warning); the cluster's configuration file stays
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
    unlocked = subprocess.run([*snakemake, "--unlock"], env=env, check=False)
    if unlocked.returncode != 0:
        return unlocked.returncode
    proc = subprocess.Popen(snakemake, env=env)
    job = scontrol.job_id()

    def time_limit_near(signum: int, frame: FrameType | None) -> None:
        print(
            f"ddppipe head: time limit of head job {job} near: stopping snakemake (the "
            "training job goes on) and requeueing; the next start attaches to it",
            file=sys.stderr, flush=True,
        )  # fmt: skip
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        if job:
            try:
                scontrol.requeue(job)
            except (OSError, subprocess.SubprocessError) as e:
                print(f"ddppipe head: requeue of {job} failed: {getattr(e, 'stderr', '') or e}",
                      file=sys.stderr, flush=True)  # fmt: skip

    signal.signal(signal.SIGUSR1, time_limit_near)
    return proc.wait()
