"""``ddppipe preflight``: the training's checks on a SLURM job's nodes, a check before a long queue.

A training slot makes these checks itself, in its own processes (its node's in
:mod:`ddppipe.parallel.node_check`, its world's in :mod:`ddppipe.training.measuring.
world_checks`): this command makes the same in two srun steps of its own, in the image when
there is one, for a job that does not train yet. One task per node checks name resolution and
the node's devices (GPU count, compute capability against the image's torch, bf16); then the
training's own shape (torchrun, every process) joins the process group with the training's
backend on the training's device, checks an all-reduce, and measures its bus bandwidth for
the whole world and for each pair of nodes and every node's GEMM peak. Each check fails within
seconds with a message naming the node.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from ddppipe.core import atomic
from ddppipe.core.errors import UserError
from ddppipe.launching import launch
from ddppipe.parallel import devices, node_check, startup_limits
from ddppipe.parallel.precision import for_world as decide_precision
from ddppipe.settings.run_spec import RunSpec
from ddppipe.training.measuring import world_checks


class PreflightError(RuntimeError, UserError):
    """A node of the allocation cannot run the training; the message says which and why.

    ``nodes``: the nodes whose own check failed (the node check), empty when the failure names
    no node (the all-reduce step)."""

    def __init__(self, message: str, nodes: list[str] | None = None) -> None:
        super().__init__(message)
        self.nodes = nodes or []


def allreduce(use: devices.Use, precision: str, peak_out: Path | None = None,
              nodes: int = 1) -> str:  # fmt: skip
    """(A rank of the command's world, on ``nodes`` nodes) Join as training does and make the
    world's checks (:func:`ddppipe.training.measuring.world_checks.run`) in the training's
    precision, as its ranks decide it. Rank 0's line holds the figures; it writes the peaks to
    ``peak_out``."""
    from ddppipe.parallel import distributed

    ctx = distributed.setup(use, startup_limits.preflight_join_s(nodes))
    try:
        trained = decide_precision(precision, ctx.device).trained  # as training decides it
        report = world_checks.run(ctx, trained)
        if report.peak is not None and peak_out is not None:
            atomic.write_json(peak_out, report.peak)
        return report.line
    finally:
        distributed.teardown()


def _step(
    command: list[str], env: dict[str, str], what: str, nodes: int,
    hosts: list[str] | None = None,
) -> str:  # fmt: skip
    limit = startup_limits.preflight_step_s(nodes)
    try:
        result = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=limit, check=False
        )
    except subprocess.TimeoutExpired as e:
        raise PreflightError(
            f"preflight {what}: no answer within {limit}s (its limit on {nodes} nodes)"
        ) from e
    if result.returncode != 0:
        output = (result.stdout + result.stderr).splitlines()
        lines = [ln for ln in output if "preflight" in ln or "error" in ln.lower()]
        detail = "\n  ".join(dict.fromkeys(lines or result.stderr.splitlines()[-10:]))
        raise PreflightError(
            f"preflight {what} failed (exit {result.returncode}):\n  {detail}",
            node_check.failing_nodes(result.stderr, hosts or []),
        )
    return result.stdout


def run(spec: RunSpec, plan: launch.Plan, python: list[str]) -> str:
    """Both checks on the job's nodes (``python``: the run's), one srun step each, their
    limits grown with the nodes (:mod:`ddppipe.parallel.startup_limits`); raise
    PreflightError."""
    request, job = plan.request, str(plan.job)
    nodes = request.nodes
    use = spec.device
    precision = spec.train.precision
    node_args = [f"--host={request.rendezvous_host}"] if request.rendezvous_host else []
    node_step = [
        *request.srun(job, kill_on_bad_exit=False, nodelist=plan.hosts),
        *python,
        "-m", "ddppipe", "preflight-node", *node_args, f"--nproc={request.procs_per_node}",
        f"--use={use}", f"--precision={precision}",
    ]  # fmt: skip
    out = _step(node_step, plan.env, "node check", nodes, plan.hosts)
    allreduce_plan = launch.plan(
        spec, ["preflight-allreduce", f"--use={use}", f"--precision={precision}",
               f"--nodes={nodes}"],
        python, plan.env, plan.hosts, max_restarts=0,
        join_timeout_s=startup_limits.preflight_join_s(nodes),
    )  # fmt: skip
    out += _step(allreduce_plan.command, allreduce_plan.env, "all-reduce", nodes)
    return out
