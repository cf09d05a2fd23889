"""A node's ``ddppipe agent``: torchrun in this process (srun starts one on each node of a
SLURM step), its node's checks first, its killed ranks recorded, its node's ranks summarised."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from ddppipe.core import env_names, memory, process_times, slot
from ddppipe.parallel import node_check
from ddppipe.runstate import failures, finished_nodes, preemption
from ddppipe.runstate.state import StateDir
from ddppipe.slurm import request as slurm_request
from ddppipe.slurm.placement import Placement
from ddppipe.training.measuring import node_summary


def run_agent(torchrun_argv: list[str]) -> int:
    """torchrun in this process, surviving SIGUSR1, passing a worker's exit 75 on.

    torchrun's folder of its workers' error files (``--log-dir``; by default one it makes in
    /tmp and leaves there, a folder a node for every step) is removed once it ended.

    SLURM signals every process of the step; torchrun's agent would die of SIGUSR1 (its
    default action). Ignoring it here is inherited by the workers until they install their
    own handler (ddppipe.runstate.preemption), so no process dies of it. Workers that stopped on a
    signal exit 0 under the agent, so ``--max-restarts`` never restarts them in place in an
    allocation that is about to end; the launcher turns their stop note into the slot's
    outcome. A worker killed by a signal (the OOM killer's SIGKILL) is recorded for its rank
    (:func:`record_killed`). First, before it imports torch, its node's own checks
    (:func:`ddppipe.parallel.node_check.agent_problems`): a failing one is said on stderr and
    ends the agent (exit 3) before it joins the rendezvous.
    """
    placement = Placement.from_env(os.environ)
    if placement is not None:  # a packed trial: this node's slot of the allocation
        placement.apply(os.environ)
    if "--rdzv-backend=c10d" in torchrun_argv and not any(
        a.startswith("--rdzv-endpoint") for a in torchrun_argv
    ):  # the step's first node: a step may run on a subset of its job's nodes
        torchrun_argv = [
            f"--rdzv-endpoint={slurm_request.step_rendezvous(os.environ)}",
            *torchrun_argv,
        ]
    endpoint = next((a.split("=", 1)[1] for a in torchrun_argv
                     if a.startswith("--rdzv-endpoint=")), "")  # fmt: skip
    problems = node_check.agent_problems(endpoint.rpartition(":")[0] or None)
    if problems:  # this node's own checks, before it joins the rendezvous
        node_check.say(problems)
        return node_check.EXIT_CODE
    logs = None
    if not any(a.startswith(("--log-dir", "--log_dir")) for a in torchrun_argv):
        logs = tempfile.mkdtemp(prefix="ddppipe-agent-")
        torchrun_argv = [f"--log-dir={logs}", *torchrun_argv]
    signal.signal(preemption.stop_signal(), signal.SIG_IGN)
    os.environ[env_names.UNDER_AGENT] = "1"  # workers that stop on a signal exit 0
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.run import main as torchrun_main

    process_times.mark("imported")  # the workers' start-up counts from the agent's
    os.environ[env_names.AGENT_MARKS] = json.dumps(process_times.own("agent_"))
    oom_kills = memory.oom_kills()
    end_beats = node_summary.start()  # its ranks' progress, and the sign that this node lives
    try:
        torchrun_main(torchrun_argv)
    except ChildFailedError as e:
        record_killed({rank: f.exitcode for rank, f in e.failures.items()}, oom_kills)
        codes = {f.exitcode for f in e.failures.values()}
        print(f"{e}\nddppipe agent: workers exited {sorted(codes)}", file=sys.stderr)
        return preemption.EXIT_CODE if preemption.EXIT_CODE in codes else 1
    except RendezvousError as e:  # the nodes did not meet: no rank of the user's code ran
        failure = record_rendezvous(type(e).__name__, endpoint, _join_timeout(torchrun_argv))
        print(f"ddppipe agent: {failure.cause()}", file=sys.stderr)
        return 1
    finally:
        end_beats()
        if logs is not None:
            shutil.rmtree(logs, ignore_errors=True)
    finished_nodes.mark()
    return 0


def _join_timeout(torchrun_argv: list[str]) -> int | None:
    """torchrun's rendezvous join timeout in ``torchrun_argv`` (``--rdzv-conf=join_timeout=N``),
    None where it is not given."""
    conf = [a.removeprefix("--rdzv-conf=") for a in torchrun_argv if a.startswith("--rdzv-conf=")]
    items = dict(item.partition("=")[::2] for item in ",".join(conf).split(",") if item)
    value = items.get("join_timeout", "")
    return int(value) if value.isdigit() else None


def record_rendezvous(error_type: str, endpoint: str, timeout_s: int | None) -> failures.Failure:
    """(The node's agent) Its failed rendezvous (torch's ``error_type``), recorded in the slot's
    failures folder in the workers' last start (:func:`failures.rendezvous_failed`)."""
    found = slot.read()
    folder = StateDir(Path(found.state)).failures if found else None
    restart = failures.last_restart(folder) if folder else 0
    return failures.rendezvous_failed(folder, error_type, endpoint, timeout_s, restart)


def record_killed(exit_codes: dict[int, int], oom_kills_before: int | None) -> None:
    """(The node's agent) Record each rank of ``exit_codes`` (global rank: its exit code as
    torchrun reports it, -N for signal N) that a signal killed, in the slot's failures folder
    as the workers' last start; the OOM killer named when the cgroup's count of its kills
    rose from ``oom_kills_before``."""
    found = slot.read()
    if found is None:
        return
    folder = StateDir(Path(found.state)).failures
    now = memory.oom_kills()
    oom = now is not None and oom_kills_before is not None and now > oom_kills_before
    restart = failures.last_restart(folder)
    for rank, code in sorted(exit_codes.items()):
        if code < 0:
            failures.killed(folder, rank, -code, restart, oom_killer=oom)
