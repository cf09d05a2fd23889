"""From a config to the command line that starts training: torchrun on one node."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any


def threads_per_proc(cfg: dict[str, Any], cpus: int) -> int:
    """CPU threads for each training process: configured, or the node's CPUs shared out."""
    configured = cfg["launch"].get("threads_per_proc")
    if configured:
        return configured
    return max(1, cpus // cfg["launch"]["nproc_per_node"])


def available_cpus() -> int:
    """CPUs this process may use (SLURM's allocation or the affinity mask)."""
    if "SLURM_CPUS_ON_NODE" in os.environ:
        return int(os.environ["SLURM_CPUS_ON_NODE"])
    return len(os.sched_getaffinity(0))


def local_torchrun(cfg: dict[str, Any], train_args: list[str]) -> list[str]:
    """``torchrun --standalone`` with the configured processes, running ``ddppipe train``."""
    launch = cfg["launch"]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes=1",
        f"--nproc-per-node={launch['nproc_per_node']}",
        f"--max-restarts={launch['max_restarts']}",
        "-m",
        "ddppipe",
        "train",
        *train_args,
    ]


def environment(cfg: dict[str, Any], cpus: int) -> dict[str, str]:
    """Environment for the launched processes (thread counts)."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(threads_per_proc(cfg, cpus))
    return env


def exec_command(command: list[str], env: dict[str, str]) -> None:
    """Replace this process with ``command`` (so signals reach the launcher directly)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(command[0], command, env)


def train_args(config: Path, data: Path, state: Path, checkpoint: Path, metrics: Path) -> list[str]:
    return [
        f"--config={config}",
        f"--data={data}",
        f"--state={state}",
        f"--checkpoint={checkpoint}",
        f"--metrics={metrics}",
    ]
