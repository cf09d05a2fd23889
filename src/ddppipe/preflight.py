"""Checks on the job's allocation before training: name resolution, GPUs, an all-reduce.

Each check fails within seconds with a message naming the node and the problem, instead of
a training job that hangs in the rendezvous until its time limit.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from typing import Any

from ddppipe import launch
from ddppipe.errors import UserError

STEP_TIMEOUT_S = 90
ALLREDUCE_JOIN_TIMEOUT_S = 30


class PreflightError(RuntimeError, UserError):
    """A node of the allocation cannot run the training; the message says which and why."""


def check_node(host: str, gpus: int, nproc: int) -> list[str]:
    """Problems of this node: rendezvous host unresolvable, fewer GPUs than processes."""
    me = socket.gethostname()
    problems = []
    try:
        socket.getaddrinfo(host, None)
    except OSError as e:
        problems.append(f"{me}: cannot resolve the rendezvous host {host!r} ({e})")
    if gpus:
        visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
        if len(visible) < nproc:
            problems.append(
                f"{me}: sees {len(visible)} GPUs (CUDA_VISIBLE_DEVICES="
                f"{os.environ.get('CUDA_VISIBLE_DEVICES', '')!r}) but runs {nproc} processes"
            )
    return problems


def allreduce() -> str:
    """All-reduce rank+1 over the world (gloo); raise unless it sums to W(W+1)/2."""
    import datetime

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=ALLREDUCE_JOIN_TIMEOUT_S))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        value = torch.tensor([rank + 1.0])
        dist.all_reduce(value)
        expected = world * (world + 1) / 2
        if value.item() != expected:
            raise PreflightError(
                f"{socket.gethostname()} rank {rank}: all-reduce gave {value.item()}, "
                f"expected {expected}"
            )
        return f"{socket.gethostname()} rank {rank}/{world}: all-reduce ok"
    finally:
        dist.destroy_process_group()


def _step(command: list[str], env: dict[str, str], what: str) -> str:
    try:
        result = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=STEP_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired as e:
        raise PreflightError(f"preflight {what}: no answer within {STEP_TIMEOUT_S}s") from e
    if result.returncode != 0:
        output = (result.stdout + result.stderr).splitlines()
        lines = [ln for ln in output if "preflight" in ln or "error" in ln]
        detail = "\n  ".join(lines or result.stderr.splitlines()[-10:])
        raise PreflightError(f"preflight {what} failed (exit {result.returncode}):\n  {detail}")
    return result.stdout


def run(cfg: dict[str, Any], plan: launch.Plan) -> str:
    """Both checks on the job's nodes, one srun step each; raise PreflightError."""
    request, job = plan.request, str(plan.job)
    host = request.rendezvous(job, plan.hosts).rsplit(":", 1)[0]
    node_check = [
        *request.srun(job, kill_on_bad_exit=False),
        sys.executable, "-m", "ddppipe", "preflight-node", f"--host={host}",
        f"--gpus={request.gpus_per_node}", f"--nproc={request.procs_per_node}",
    ]  # fmt: skip
    out = _step(node_check, plan.env, "node check")
    allreduce = launch.plan(
        cfg, ["preflight-allreduce"], plan.env, plan.hosts, max_restarts=0,
        join_timeout_s=ALLREDUCE_JOIN_TIMEOUT_S,
    )  # fmt: skip
    out += _step(allreduce.command, allreduce.env, "all-reduce")
    return out
