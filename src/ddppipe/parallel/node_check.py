"""A node's own checks, made by the training's processes before they join its world.

A SLURM slot of its own (its slot record's ``checks``) has no preflight world of its own: its
processes check their node as they start, and a failing check prints one line,
``preflight: <node>: <problem>``, on stderr, which the launcher reads from its srun step
(:mod:`ddppipe.launching.launch`) to name the nodes it excludes from the next slot
(:mod:`ddppipe.slurm.bad_nodes`). Two kinds of process check:

- the node's agent (``ddppipe agent``, before torchrun's rendezvous, :func:`agent_problems`):
  the rendezvous host resolves; the node reads the slot record as its launcher wrote it, so it
  sees the run's state folder (a shared filesystem not mounted or stale on a node fails here,
  not at the first checkpoint);
- every rank, before it joins the process group (:func:`before_joining`): its node's devices
  fit the run (a GPU each, usable, its compute capability against this torch, bf16). The ranks
  exchange what they found through torchrun's store before any exits, so every failing node
  is named (not only the first whose exit ends the step), and no rank joins a group on a GPU
  it cannot use.

``ddppipe preflight-node`` (the node step of ``ddppipe preflight``, a packed allocation's node
worker) makes the same checks with :func:`check_node`. The checks of the world once joined
(all-reduce, bandwidth, GEMM peak) are :mod:`ddppipe.training.measuring.world_checks`'.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import sys
from collections.abc import Mapping
from typing import Any

from ddppipe.core import slot
from ddppipe.core.errors import UserError
from ddppipe.core.rendezvous import first_host, step_nodelist
from ddppipe.parallel import devices, environments

PREFIX = "preflight: "  # a failing check's line on stderr: "preflight: <node>: <problem>"
EXIT_CODE = 3  # a process whose node (or another node of its world) failed a check


class NodeUnfit(RuntimeError, UserError):
    """A node of the world cannot run the training (the message names each and why), or ranks
    never reported their node's checks (the message names them)."""


def host_problem(host: str | None) -> str | None:
    """Why this node cannot resolve the rendezvous ``host``; None when it can (or no host). An
    IPv6 address in brackets (``[fd00::1]``, as an endpoint writes it) is the address."""
    if not host:
        return None
    try:
        socket.getaddrinfo(host.removeprefix("[").removesuffix("]"), None)
    except OSError as e:
        return f"{socket.gethostname()}: cannot resolve the rendezvous host {host!r} ({e})"
    return None


def slot_problem(env: Mapping[str, str] | None = None) -> str | None:
    """Why this node does not see the run's state folder (:func:`ddppipe.core.slot.unseen`)."""
    seen = slot.unseen(env)
    if seen is None:
        return None
    return (
        f"{socket.gethostname()}: does not see the run's state folder as the job's first node "
        f"does ({seen}): the shared filesystem is not mounted here, or stale; checkpoints and "
        "logs live there"
    )


def device_check(nproc: int, use: devices.Use, precision: str) -> tuple[str, list[str]]:
    """This node's devices for ``nproc`` processes: its report, and its problem if unfit."""
    try:
        return devices.node_check(nproc, use, precision), []
    except devices.DeviceError as e:
        return "", [str(e)]


def check_node(
    host: str | None, nproc: int, use: devices.Use, precision: str
) -> tuple[str, list[str]]:
    """(``ddppipe preflight-node``) This node's report, and its problems: the rendezvous
    ``host`` (else its step's first node) unresolvable, its devices unfit."""
    nodelist = step_nodelist(os.environ)
    host = host or (first_host(nodelist) if nodelist else None)
    report, problems = device_check(nproc, use, precision)
    return report, [p for p in [host_problem(host)] if p] + problems


def agent_problems(host: str | None) -> list[str]:
    """(``ddppipe agent``, before torchrun) The rendezvous ``host`` unresolvable here; the slot
    record not its launcher's here."""
    return [p for p in (host_problem(host), slot_problem()) if p]


def failing_nodes(said: str, hosts: list[str]) -> list[str]:
    """The ``hosts`` whose check failed, as ``said`` (a step's stderr) names them."""
    lines = said.splitlines()
    return [h for h in hosts if any(line.startswith(f"{PREFIX}{h}: ") for line in lines)]


def say(problems: list[str]) -> None:
    """Each problem as its line on stderr, for the launcher (:data:`PREFIX`)."""
    for problem in problems:
        print(f"{PREFIX}{problem}", file=sys.stderr, flush=True)


def before_joining(use: devices.Use, precision: str, timeout_s: float) -> None:
    """(A rank of a checked slot, before it joins the process group) Check this node's devices
    for its processes; local rank 0 says a problem at once. Under torchrun the ranks exchange
    their problems first (waiting up to ``timeout_s``), and another rank says one of its own
    that no lower rank found (its node's local rank 0 found none: a GPU failing between the
    two checks): every rank raises NodeUnfit when any node failed, after every failing node
    said why."""
    env = environments.detect(os.environ)
    _, mine = device_check(env.local_world_size or 1, use, precision)
    if mine and env.local_rank == 0:
        say(mine)
    try:
        per_rank = _exchanged(mine, env.rank, env.world_size, timeout_s)
    except NodeUnfit:
        if mine:  # (said above, or here): this node's problem is the one to name
            if env.local_rank != 0:
                say(mine)
            raise NodeUnfit("; ".join(p.splitlines()[0] for p in mine)) from None
        raise
    if per_rank is None:
        problems = mine
    else:
        if env.local_rank != 0:
            lower = {p for r, found in per_rank.items() if r < env.rank for p in found}
            say([p for p in mine if p not in lower])
        problems = [p for _, found in sorted(per_rank.items()) for p in found]
    if problems:
        raise NodeUnfit("; ".join(dict.fromkeys(p.splitlines()[0] for p in problems)))


def _exchanged(mine: list[str], rank: int, world: int,
               timeout_s: float) -> dict[int, list[str]] | None:  # fmt: skip
    """The problems of every rank that found one (by rank), through the store torchrun's
    agents serve (:func:`exchange`); None without one (another launcher, a world of one)."""
    env = os.environ
    if world < 2 or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    client = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                           timeout=timeout)  # fmt: skip
    restart = env.get("TORCHELASTIC_RESTART_COUNT", "0")  # a restarted group asks afresh
    return exchange(dist.PrefixStore(f"ddppipe/node-check/{restart}/", client), mine, rank,
                    world, timeout_s)  # fmt: skip


def exchange(store: Any, mine: list[str], rank: int, world: int,
             timeout_s: float) -> dict[int, list[str]]:  # fmt: skip
    """The problems of every rank that found one (by rank), in a few requests a rank to
    ``store`` whatever the world's size: each rank marks itself reported and adds itself to
    the count (a rank with problems sets them and appends itself to the failing list); the
    rank that makes the count whole says so; each then reads the failing list, and the
    problems of those ranks only. NodeUnfit naming the ranks that did not report within
    ``timeout_s`` (their marks read then, one by one)."""
    import torch.distributed as dist

    if mine:
        store.set(str(rank), json.dumps(mine))
        store.append("failing", f"{rank},")
    store.set(f"reported/{rank}", "")
    if store.add("reported", 1) == world:
        store.set("all-reported", "")
    try:
        store.wait(["all-reported"], datetime.timedelta(seconds=timeout_s))
    except dist.DistStoreError as e:
        silent = []
        with contextlib.suppress(dist.DistError):  # (the agent's store gone: none named)
            silent = [str(r) for r in range(world) if not store.check([f"reported/{r}"])]
        raise NodeUnfit(
            f"{socket.gethostname()} rank {rank}: rank(s) {', '.join(silent) or '?'} of "
            f"{world} did not report their node's checks within {timeout_s:.0f} s: their "
            "processes failed or hang before joining (their node's lines and the step's "
            "stderr say which)"
        ) from e
    if not store.check(["failing"]):
        return {}
    failing = sorted({int(r) for r in store.get("failing").decode().split(",") if r})
    return {r: json.loads(store.get(str(r))) for r in failing}
