"""The local launch command and the CPU threads a training job takes."""

from __future__ import annotations

import sys

from ddppipe import launch
from tests.tiny import default_config


def test_threads_are_configured_or_the_cpus_shared_out() -> None:
    cfg = default_config()
    cfg["launch"].update(nproc_per_node=2, threads_per_proc=None)
    assert launch.threads_per_proc(cfg, 16) == 8
    assert launch.threads_per_proc(cfg, 1) == 1  # never zero threads
    cfg["launch"]["threads_per_proc"] = 3
    assert launch.threads_per_proc(cfg, 16) == 3


def test_job_threads_count_every_process_thread() -> None:
    cfg = default_config()
    cfg["launch"].update(nproc_per_node=2, threads_per_proc=3)
    assert launch.job_threads(cfg) == 6
    cfg["launch"]["threads_per_proc"] = None  # all of this machine's CPUs
    assert launch.job_threads(cfg) == 2 * max(1, launch.available_cpus() // 2)


def test_local_command_is_a_standalone_sigusr1_safe_agent() -> None:
    cfg = default_config()
    cfg["launch"].update(nproc_per_node=3, max_restarts=1)
    command = launch.local_torchrun(cfg, ["--config=c.yaml"])
    assert command[:4] == [sys.executable, "-m", "ddppipe", "agent"]
    assert {"--standalone", "--nproc-per-node=3", "--max-restarts=1"} <= set(command)
    assert command[-4:] == ["-m", "ddppipe", "train", "--config=c.yaml"]


def test_launched_processes_get_the_same_omp_and_mkl_threads(monkeypatch) -> None:
    """Snakemake exports MKL_NUM_THREADS = the job's threads; torch would let it win."""
    monkeypatch.setenv("MKL_NUM_THREADS", "8")
    cfg = default_config()
    cfg["launch"].update(nproc_per_node=2, threads_per_proc=None)
    env = launch.environment(cfg, 4)
    assert (env["OMP_NUM_THREADS"], env["MKL_NUM_THREADS"]) == ("2", "2")
    cfg["slurm"]["cpus_per_task"] = 3
    env = launch.slurm_environment(cfg)
    assert (env["OMP_NUM_THREADS"], env["MKL_NUM_THREADS"]) == ("3", "3")
