"""``ddppipe pack-worker``: one node of a held allocation, running the sweep's trials.

The node's CPUs (and GPUs) are cut into ``slots`` equal parts; each slot takes the first
waiting trial from the pool the moment it is free and runs the trial's launch command there
(built from its ticket, in this worker's folder: the sweep's working folder),
as a one-node local run (its ranks forked by this node's warm server). A multi-node trial
takes a slot on each of that many nodes (:mod:`ddppipe.packing.gang`, led by the allocation's
first node) and runs as an srun step on them. Before the allocation's
end (``slurm.signal_seconds``) the running trials stop: they checkpoint and go back to the
queue, for the next allocation. Each trial's launcher times that warning itself, from the
allocation's end in its environment (:data:`ddppipe.core.env_names.ALLOCATION_END`),
as in a job of its own: a signal sent by this worker could reach a trial started a moment
before, whose handlers are not set yet. No trial starts after the warning. The worker ends at
its time limit, or when no trial runs and none waits, once the submitting Snakemake's call
ended (or none came for :data:`IDLE_EXIT_S` seconds).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddppipe.core import atomic, env_names
from ddppipe.launching import warm
from ddppipe.packing import tickets
from ddppipe.packing.allocation import PackError
from ddppipe.packing.gang import Gang, Seat, open_gangs
from ddppipe.packing.pool import Pool
from ddppipe.packing.tickets import Ticket
from ddppipe.runstate import preemption
from ddppipe.slurm import scontrol

log = logging.getLogger(__name__)

IDLE_EXIT_S = 30.0  # no trial waiting or running this long: give the allocation back
POLL_S = 0.2
STOP_WAIT_S = 20.0  # a cut allocation's trials: time to checkpoint (SLURM's KillWait: 30 s)


@dataclass
class Slot:
    """A share of the node: its CPUs, GPUs and the trial it runs."""

    index: int
    cpus: list[int]
    gpus: list[str]
    trial: Ticket | None = None
    process: subprocess.Popen | None = None
    started: float = 0.0
    busy_s: float = 0.0
    last_end: float | None = None  # when its last trial ended
    trials: list[str] = field(default_factory=list)
    gang: Gang | None = None  # a multi-node trial's: led (``trial`` set) or seated in

    @property
    def busy(self) -> bool:
        return self.process is not None or self.gang is not None

    @property
    def forming(self) -> bool:
        """It leads a gang whose seats are not all taken yet (its trial not started)."""
        return self.gang is not None and self.trial is not None and self.process is None

    def seat(self, node: str) -> Seat:
        return Seat(node, self.index, self.cpus, self.gpus)


def shares(items: list, parts: int) -> list[list]:
    """``items`` cut into ``parts`` equal consecutive shares (the rest left out)."""
    size = len(items) // parts
    return [items[k * size : (k + 1) * size] for k in range(parts)]


def slots_of_node(count: int, env: dict[str, str], gpus_each: int = 0) -> list[Slot]:
    """This node's ``count`` slots: its CPUs (this process's) and GPUs
    (``CUDA_VISIBLE_DEVICES`` of the allocation) shared out; ``gpus_each``: the GPUs a
    trial needs (its processes on a GPU run). PackError when the node cannot give each slot
    GPUs of its own: never two trials on one GPU."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < count:
        raise PackError(f"{len(cpus)} CPU(s) cannot hold {count} slots")
    visible = [g for g in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if g]
    if gpus_each and len(visible) < count * gpus_each:
        shown = env.get("CUDA_VISIBLE_DEVICES")
        raise PackError(
            f"{count} slot(s) of {gpus_each} GPU(s) each need {count * gpus_each} GPUs of "
            f"the allocation, and its step shows {len(visible)} (CUDA_VISIBLE_DEVICES="
            f"{'unset' if shown is None else repr(shown)}): the trials would share GPUs. Ask "
            "the allocation for them (sweep.pack with launch.device: gpu requests --gres; a "
            "site without GPU gres cannot pack GPU trials), or use fewer "
            "sweep.pack.trials_per_node"
        )
    gpus = shares(visible, count) if gpus_each else [[] for _ in range(count)]
    return [Slot(k, c, g) for k, (c, g) in enumerate(zip(shares(cpus, count), gpus, strict=True))]


def trial_environment(env: dict[str, str], job: str, node: str, slot: Slot,
                      warm_socket: Path, server: int) -> dict[str, str]:  # fmt: skip
    """A trial's launcher environment: a local run of this node (no SLURM variables: the
    allocation is not its job), in its slot, its ranks forked warm."""
    own = {k: v for k, v in env.items() if not k.startswith("SLURM_")}
    own.update({env_names.PACKED_SLOT: f"{job} {node}/{slot.index}",
                env_names.WARM_SOCKET: str(warm_socket),
                env_names.WARM_SERVER: str(server)})  # fmt: skip
    if slot.gpus:
        own["CUDA_VISIBLE_DEVICES"] = ",".join(slot.gpus)
    return own


def preflight(slots: int, nproc: int, use: str, precision: str) -> list[str]:
    """This node's check for ``slots`` trials of ``nproc`` processes on ``use`` (the run's
    preflight node check, ``ddppipe preflight-node``, in a process of its own: a GPU check
    must not leave a CUDA context in this one); its problems, none when it may train."""
    done = subprocess.run(
        [sys.executable, "-m", "ddppipe", "preflight-node", "--nproc", str(slots * nproc),
         "--use", use, "--precision", precision, "--host", socket.gethostname()],
        capture_output=True, text=True, check=False, timeout=300,
    )  # fmt: skip
    if done.returncode == 0:
        return []
    lines = [line.removeprefix("preflight: ") for line in done.stderr.splitlines()]
    return [line for line in lines if line.strip()] or [f"exit {done.returncode}"]


def serve(pool_root: Path, slots: int, signal_seconds: int, stop_signal: str,
          check: tuple[int, str, str] | None = None) -> int:  # fmt: skip
    """Run the pool's trials on this node's ``slots`` until the allocation ends or no trial
    is left; 0. ``check``: a trial's processes, device and precision, checked first (a node
    that fails takes no trial, and the pool's next allocations exclude it)."""
    pool = Pool(pool_root)
    env = dict(os.environ)
    job = scontrol.job_id(env) or "local"
    node = env.get("SLURMD_NODENAME") or socket.gethostname()
    leads = job == "local" or scontrol.job_nodes(job)[0] == node  # leads the gangs
    record_path = pool.allocations / "nodes" / f"{job}-{node}.json"
    record_path.parent.mkdir(parents=True, exist_ok=True)
    left = scontrol.seconds_left(scontrol.job_record(job)) if job != "local" else None
    end = None if left is None else time.time() + left
    if end is not None:  # the trials' launchers warn their ranks (preemption.allocation_warning)
        env[env_names.ALLOCATION_END] = f"{end - signal_seconds:.3f} {end:.3f}"
    sock = warm.local_socket(f"ddppipe-warm-{job}-{node}.sock")
    server = warm.start(sock, pool.allocations / "nodes" / f"{job}-{node}.warm.log")
    own, problems = _node_slots(slots, env, check)
    record = {"job": job, "node": node, "slots": slots, "started": time.time(),
              "cpus": len(os.sched_getaffinity(0)),
              "gpus": sum(len(s.gpus) for s in own)}  # fmt: skip
    problems = problems or (preflight(slots, *check) if check else [])
    if problems:
        log.error("node %s failed its preflight: it takes no trial (%s)", node,
                  "; ".join(problems))  # fmt: skip
        server.terminate()
        server.wait()
        atomic.write_json(record_path, {**record, "ended": time.time(), "preflight": problems,
                                        "slot_records": []})  # fmt: skip
        return 0
    atomic.write_json(record_path, record)
    stopping, idle_since = False, time.monotonic()
    sig = getattr(signal, stop_signal, signal.SIGUSR1)

    def cancelled(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)  # scancel: the trials stop (and go back), records close

    signal.signal(signal.SIGTERM, cancelled)
    log.info("allocation %s, node %s: %d slot(s), %s", job, node, slots,
             "no time limit" if end is None else f"{left:.0f} s left")  # fmt: skip
    try:
        while True:
            if not stopping and end is not None and time.time() >= end - signal_seconds:
                stopping = True  # the running trials stop by their own timers
                log.warning("time-limit warning: no new trial; the running ones stop")
                atomic.write_json(record_path, {**record, "stopping": time.time()})
            busy = _step(pool, own, stopping, job, node, leads, env, sock, server.pid)
            if busy or pool.waiting():
                idle_since = time.monotonic()
            idle = time.monotonic() - idle_since
            if not busy and (stopping or pool.closed.exists() or idle > IDLE_EXIT_S):
                break
            time.sleep(POLL_S)
    finally:
        _stop_trials(pool, own, sig, job, node)
        server.terminate()
        server.wait()
        _close(record_path, record, own)
    return 0


def _close(record_path: Path, record: dict[str, Any], own: list[Slot]) -> None:
    """The node's record, ended: what each of its slots did."""
    atomic.write_json(record_path, {
        **record, "ended": time.time(),
        "slot_records": [{"busy_s": s.busy_s, "last_end": s.last_end, "trials": s.trials}
                         for s in own],
    })  # fmt: skip


def _node_slots(slots: int, env: dict[str, str],
                check: tuple[int, str, str] | None) -> tuple[list[Slot], list[str]]:  # fmt: skip
    """This node's slots (its GPUs shared out when the trials train on GPUs); none and why
    when it cannot hold them."""
    try:
        return slots_of_node(slots, env, check[0] if check and check[1] == "gpu" else 0), []
    except PackError as e:
        return [], [str(e)]


def _step(pool: Pool, own: list[Slot], stopping: bool, job: str, node: str, leads: bool,
          env: dict[str, str], sock: Path, server_pid: int) -> bool:  # fmt: skip
    """One pass over the node's slots: ended trials closed, gangs seated (or disbanded once
    the allocation stops), free slots given the next trial; whether a slot is busy."""
    for s in own:
        if s.process is not None and s.process.poll() is not None:
            _ended(pool, s, job, node)
        elif s.gang is not None and s.trial is None and not s.gang.is_open:
            _unseated(s)
        elif s.forming:
            if stopping:
                _disband(pool, s)
            elif s.gang.full:  # type: ignore[union-attr]
                _launch(s, job, node, env, sock, server_pid)
    if not stopping:
        for s in own:
            if not s.busy:
                _start(pool, s, job, node, leads, own, env, sock, server_pid)
    return any(s.busy for s in own)


def _stop_trials(pool: Pool, own: list[Slot], sig: signal.Signals, job: str, node: str) -> None:
    """The allocation is cut short (scancel, or SLURM ends it): the running trials get the
    stop signal and :data:`STOP_WAIT_S` seconds to checkpoint; those that did go back to the
    queue (the others are reclaimed when SLURM no longer holds the allocation)."""
    for s in own:
        if s.forming:
            _disband(pool, s)
    running = [s for s in own if s.process is not None]
    for s in running:
        with contextlib.suppress(ProcessLookupError):
            s.process.send_signal(sig)  # type: ignore[union-attr]
    deadline = time.monotonic() + STOP_WAIT_S
    while running and time.monotonic() < deadline:
        for s in [s for s in running if s.process.poll() is not None]:  # type: ignore[union-attr]
            _ended(pool, s, job, node)
            running.remove(s)
        time.sleep(POLL_S)


def _start(pool: Pool, slot: Slot, job: str, node: str, leads: bool, own: list[Slot],
           env: dict[str, str], sock: Path, server: int) -> None:  # fmt: skip
    """A free slot: a seat of a forming gang first (another node leads it), else the next
    trial (the leading node: of as many nodes as the allocation has working, one gang forming
    at a time)."""
    if not leads:
        for gang in open_gangs(pool, job):
            if gang.sit(slot.seat(node)):
                log.info("slot %d: a seat of %s's gang", slot.index, gang.run)
                slot.gang, slot.started = gang, time.time()
                slot.trials.append(gang.run)
                return
    forming = any(s.forming for s in own)
    max_nodes = pool.working_nodes(job) if leads and not forming else 1
    ticket = pool.take({"job": job, "node": node, "slot": slot.index}, max_nodes)
    if ticket is None:
        return
    log.info("slot %d: %s (waited %.1f s)", slot.index, ticket.run, time.time() - ticket.queued)
    slot.trial, slot.started = ticket, time.time()
    if ticket.nodes > 1:
        slot.gang = Gang.open(pool, job, ticket, slot.seat(node))
        log.info("slot %d: %s waits for a slot on %d other node(s)", slot.index, ticket.run,
                 ticket.nodes - 1)  # fmt: skip
        return
    _popen(slot, trial_environment(env, job, node, slot, sock, server))


def _launch(slot: Slot, job: str, node: str, env: dict[str, str], sock: Path,
            server: int) -> None:  # fmt: skip
    """The leader's gang is complete: the trial's launcher runs its srun step on the gang's
    nodes."""
    assert slot.gang is not None and slot.trial is not None
    placement = slot.gang.placement()
    own = trial_environment(env, job, node, slot, sock, server)
    own.update({**placement.to_env(), env_names.PACKED_SLOT: f"{job} {slot.gang.slots()}"})
    log.info("slot %d: %s on %s", slot.index, slot.trial.run, ",".join(placement.nodes))
    _popen(slot, own)


def _popen(slot: Slot, env: dict[str, str]) -> None:
    assert slot.trial is not None
    cpus = slot.cpus
    slot.process = subprocess.Popen(
        tickets.launch_command(slot.trial), env=env, start_new_session=True,
        preexec_fn=lambda: os.sched_setaffinity(0, cpus),
    )  # fmt: skip


def _disband(pool: Pool, slot: Slot) -> None:
    """The leader's gang still forming ends (the allocation is ending): its trial waits in
    the queue again, first in line, and the seats taken are free."""
    assert slot.gang is not None and slot.trial is not None
    pool.give_back(slot.trial)
    slot.gang.close()
    slot.trial, slot.gang = None, None


def _unseated(slot: Slot) -> None:
    """The gang this slot sat in closed: its trial ended, or went back to the queue."""
    assert slot.gang is not None
    ended = time.time()
    slot.busy_s += ended - slot.started
    slot.last_end = ended
    slot.gang = None


def _ended(pool: Pool, slot: Slot, job: str, node: str) -> None:
    assert slot.process is not None and slot.trial is not None
    code = slot.process.returncode
    ended = time.time()
    slot.busy_s += ended - slot.started
    slot.last_end = ended
    slot.trials.append(slot.trial.run)
    if code == preemption.EXIT_CODE:  # stopped on the signal after a checkpoint: goes on
        log.info("slot %d: %s checkpointed; it waits for the next slot", slot.index,
                 slot.trial.run)  # fmt: skip
        pool.give_back(slot.trial)
    else:
        log.info("slot %d: %s ended (exit %d) after %.1f s", slot.index, slot.trial.run, code,
                 ended - slot.started)  # fmt: skip
        pool.finish(slot.trial, {"exit": code, "job": job, "node": node, "slot": slot.index,
                                 "started": slot.started, "ended": ended})  # fmt: skip
    if slot.gang is not None:
        slot.gang.close()
    slot.trial, slot.process, slot.gang = None, None, None
