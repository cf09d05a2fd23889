"""Checks on the job's nodes before training, with what training will use.

Two srun steps, in the image when there is one: one task per node checks name resolution,
that it sees the run's state folder as the launcher does (a token the launcher just wrote: a
shared filesystem not mounted or stale on a node fails here, not at the first checkpoint) and
the node's devices (GPU count, compute capability against the image's torch, bf16); then the
training's own shape (torchrun, every process) joins the process group with the training's
backend on the training's device, checks an all-reduce, and measures its bus bandwidth for
the whole world and for each pair of nodes. Each check fails within seconds with a message
naming the node, instead of a training job that hangs in the rendezvous until its time limit.
"""

from __future__ import annotations

import itertools
import os
import secrets
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from ddppipe.apptainer import running
from ddppipe.core import atomic
from ddppipe.core.errors import UserError
from ddppipe.core.rendezvous import first_host, step_nodelist
from ddppipe.launching import launch
from ddppipe.parallel import devices
from ddppipe.parallel.precision import for_world as decide_precision
from ddppipe.runstate.state import StateDir
from ddppipe.settings.run_spec import RunSpec
from ddppipe.training.measuring import efficiency, peak

STEP_TIMEOUT_S = 90
ALLREDUCE_JOIN_TIMEOUT_S = 30
BANDWIDTH_BYTES = 16 * 2**20  # per all-reduce of the bandwidth test
BANDWIDTH_ITERATIONS = 5


class PreflightError(RuntimeError, UserError):
    """A node of the allocation cannot run the training; the message says which and why.

    ``nodes``: the nodes whose own check failed (the node check), empty when the failure names
    no node (the all-reduce step)."""

    def __init__(self, message: str, nodes: list[str] | None = None) -> None:
        super().__init__(message)
        self.nodes = nodes or []


def sees_token(state: StateDir, token: str) -> str | None:
    """None when ``state``'s token file holds ``token``; else what this node sees instead."""
    path = state.preflight_token
    try:
        found = path.read_text().strip()
    except OSError as e:
        return f"{path}: {e.strerror or e}"
    return None if found == token else f"{path} holds another token"


def check_node(
    host: str | None, nproc: int, use: devices.Use, precision: str,
    state: StateDir | None = None, token: str | None = None,
) -> tuple[str, list[str]]:  # fmt: skip
    """This node's report, and its problems: rendezvous host unresolvable, the run's state
    folder not the launcher's (with ``state`` and ``token``), devices unfit."""
    me = socket.gethostname()
    nodelist = step_nodelist(os.environ)
    host = host or (first_host(nodelist) if nodelist else None)
    problems = []
    if host:
        try:
            socket.getaddrinfo(host, None)
        except OSError as e:
            problems.append(f"{me}: cannot resolve the rendezvous host {host!r} ({e})")
    if state is not None and token is not None and (seen := sees_token(state, token)):
        problems.append(
            f"{me}: does not see the run's state folder as the job's first node does ({seen}): "
            "the shared filesystem is not mounted here, or stale; checkpoints and logs live there"
        )
    try:
        report = devices.node_check(nproc, use, precision)
    except devices.DeviceError as e:
        problems.append(str(e))
        report = ""
    return report, problems


def bus_bandwidth(nbytes: int, ranks: int, seconds: float) -> float:
    """All-reduce bus bandwidth, bytes/s (NCCL tests' definition: 2(n-1)/n of the size per s)."""
    return nbytes * 2 * (ranks - 1) / ranks / seconds if ranks > 1 else 0.0


def _timed_allreduce(tensor: Any, group: Any = None) -> float:
    """Seconds per all-reduce of ``tensor`` within ``group`` (after one warm-up)."""
    import torch.distributed as dist

    dist.all_reduce(tensor, group=group)
    devices.synchronize(tensor.device)
    dist.barrier(group=group)
    started = time.perf_counter()
    for _ in range(BANDWIDTH_ITERATIONS):
        dist.all_reduce(tensor, group=group)
    devices.synchronize(tensor.device)
    return (time.perf_counter() - started) / BANDWIDTH_ITERATIONS


def allreduce(use: devices.Use, precision: str, peak_out: Path | None = None) -> str:
    """Join as training does, check an all-reduce, measure bus bandwidth (world, node pairs)
    and every node's GEMM peak in the training's precision (all its processes at once).

    Every rank returns its line; rank 0's also holds the figures, and writes the peaks to
    ``peak_out`` (JSON) for the slot's attempt record.
    """
    import torch
    import torch.distributed as dist

    from ddppipe.parallel import distributed

    ctx = distributed.setup(use, ALLREDUCE_JOIN_TIMEOUT_S)
    try:
        rank, world = ctx.rank, ctx.world_size
        value = torch.tensor([rank + 1.0], device=ctx.device)
        dist.all_reduce(value)
        expected = world * (world + 1) / 2
        if value.item() != expected:
            raise PreflightError(
                f"{socket.gethostname()} rank {rank}: all-reduce gave {value.item()}, "
                f"expected {expected}"
            )
        hosts: list[str] = [""] * world
        dist.all_gather_object(hosts, socket.gethostname())
        tensor = torch.ones(BANDWIDTH_BYTES // 4, device=ctx.device)
        overall = _figure(f"world ({world} ranks)", world, _timed_allreduce(tensor))
        pairs: list[str] = []  # measured by the pair's first rank
        nodes = list(dict.fromkeys(hosts))
        for a, b in itertools.combinations(nodes, 2):
            ranks = [r for r, h in enumerate(hosts) if h in (a, b)]
            group = dist.new_group(ranks)  # collective: every rank creates every group
            if rank in ranks:
                seconds = _timed_allreduce(tensor, group)
                if rank == ranks[0]:
                    pairs.append(_figure(f"{a}<->{b}", len(ranks), seconds))
        gathered: list[list[str]] = [[] for _ in range(world)]
        dist.all_gather_object(gathered, pairs)
        precision = decide_precision(precision, ctx.device).trained  # as training decides it
        nodes_peak = _gemm_peaks(ctx.device, precision, world)
        line = (
            f"{socket.gethostname()} rank {rank}/{world}: all-reduce ok "
            f"({ctx.backend} on {ctx.device})"
        )
        if rank == 0:
            line += "; bus bandwidth " + "; ".join([overall, *itertools.chain(*gathered)])
            line += f"; GEMM peak ({precision}): " + "; ".join(
                f"{host} {gflops:,.0f} GFLOP/s" for host, gflops in nodes_peak.items()
            )
            if peak_out is not None:
                atomic.write_json(peak_out, {"precision": precision, "gflops": nodes_peak})
        return line
    finally:
        distributed.teardown()


def _gemm_peaks(device: Any, precision: str, world: int) -> dict[str, float]:
    """Collective: GFLOP/s per node, every process multiplying matrices at the same time."""
    import torch.distributed as dist

    dist.barrier()
    mine = (socket.gethostname(), peak.gemm_gflops(device, precision))
    measured: list[Any] = [None] * world
    dist.all_gather_object(measured, mine)
    return efficiency.node_sums(measured)


def _figure(what: str, ranks: int, seconds: float) -> str:
    size = BANDWIDTH_BYTES / 2**20
    if ranks < 2:
        return f"{what}: no peer ({seconds * 1e3:.2f} ms per {size:.0f} MiB all-reduce)"
    return f"{what}: {bus_bandwidth(BANDWIDTH_BYTES, ranks, seconds) / 1e9:.2f} GB/s"


def failing_nodes(stderr: str, hosts: list[str]) -> list[str]:
    """The hosts whose node check printed a problem (``preflight: HOST: ...`` on stderr)."""
    lines = stderr.splitlines()
    return [h for h in hosts if any(line.startswith(f"preflight: {h}: ") for line in lines)]


def _step(
    command: list[str], env: dict[str, str], what: str, hosts: list[str] | None = None
) -> str:
    try:
        result = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=STEP_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired as e:
        raise PreflightError(f"preflight {what}: no answer within {STEP_TIMEOUT_S}s") from e
    if result.returncode != 0:
        output = (result.stdout + result.stderr).splitlines()
        lines = [ln for ln in output if "preflight" in ln or "error" in ln.lower()]
        detail = "\n  ".join(dict.fromkeys(lines or result.stderr.splitlines()[-10:]))
        raise PreflightError(
            f"preflight {what} failed (exit {result.returncode}):\n  {detail}",
            failing_nodes(result.stderr, hosts or []),
        )
    return result.stdout


def run(
    spec: RunSpec, plan: launch.Plan, peak_out: Path | None = None, state: StateDir | None = None
) -> str:
    """Both checks on the job's nodes, one srun step each; raise PreflightError. The nodes'
    GEMM peaks go to ``peak_out`` (JSON: ``precision``, ``gflops`` per node); with ``state``,
    every node must see the run's state folder."""
    request, job = plan.request, str(plan.job)
    use = spec.device
    precision = spec.train.precision
    node_args = [f"--host={request.rendezvous_host}"] if request.rendezvous_host else []
    if state is not None:
        token = secrets.token_hex(8)
        atomic.write_text(state.preflight_token, token)
        node_args += [f"--state={state.root.resolve()}", f"--token={token}"]
    node_check = [
        *request.srun(job, kill_on_bad_exit=False, nodelist=plan.hosts),
        *running.python_command(spec),
        "-m", "ddppipe", "preflight-node", *node_args, f"--nproc={request.procs_per_node}",
        f"--use={use}", f"--precision={precision}",
    ]  # fmt: skip
    out = _step(node_check, plan.env, "node check", plan.hosts)
    allreduce_plan = launch.plan(
        spec, ["preflight-allreduce", f"--use={use}", f"--precision={precision}",
              *([f"--peak-out={peak_out}"] if peak_out else [])],
        plan.env, plan.hosts, max_restarts=0, join_timeout_s=ALLREDUCE_JOIN_TIMEOUT_S,
    )  # fmt: skip
    out += _step(allreduce_plan.command, allreduce_plan.env, "all-reduce")
    return out
