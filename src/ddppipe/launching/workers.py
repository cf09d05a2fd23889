"""The training processes of a local run: started, watched and stopped together.

What torchrun's agent does on one node, without the agent: a local slot no longer pays for a
process that imports torch (1.5-8 s, with the workers' own imports waiting for it) only to
start the workers. Each worker gets torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT), so the trainer and
users' scripts see the same environment as under torchrun; rank 0 serves the rendezvous store
on a free loopback port. When one worker fails the others are stopped (SIGTERM, then SIGKILL),
and the group starts again up to ``launch.max_restarts`` times; a stop on a signal (exit
:data:`~ddppipe.runstate.preemption.EXIT_CODE`) is never restarted, nor a failure that repeats
(the same exception, user frame and step as the start before) or a non-finite loss
(:func:`ddppipe.runstate.restarts.ends_run`, the launcher's rule): restarts are for
transient faults. A worker killed by a
signal (the OOM killer's SIGKILL) cannot say so itself: the group records it for its rank
(:func:`~ddppipe.runstate.failures.killed`), the OOM killer named when its cgroup's counter
rose, so the slot names the killed rank, not a survivor's follow-on error. SLURM runs keep
torchrun's agent, whose rendezvous spans the nodes (:mod:`ddppipe.launching.launch`).
"""

from __future__ import annotations

import logging
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from ddppipe.core import memory, slot
from ddppipe.launching import warm_client
from ddppipe.runstate import failures, node_beats, preemption, restarts
from ddppipe.runstate.state import StateDir
from ddppipe.training.measuring import heartbeat

log = logging.getLogger(__name__)

POLL_S = 0.05
STOP_GRACE_S = 30.0  # a failed group's survivors get SIGTERM, then SIGKILL after this long


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def rank_environment(env: dict[str, str], rank: int, nproc: int, port: int,
                     restarts: int) -> dict[str, str]:  # fmt: skip
    """``env`` with torchrun's variables for local rank ``rank`` of ``nproc`` on one node."""
    return {
        **env,
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
        "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "ROLE_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": str(restarts),
    }  # fmt: skip


def exit_status(code: int) -> int:
    """A shell's exit status for a Popen return code (-N: 128 + N)."""
    return code if code >= 0 else 128 - code


class Group:
    """``nproc`` copies of ``command``, one per local rank, behaving as one child process:
    :meth:`send_signal` reaches every worker, :meth:`wait` returns the group's exit status."""

    def __init__(self, command: list[str], env: dict[str, str], nproc: int, max_restarts: int,
                 preexec_fn: Callable[[], None] | None = None) -> None:  # fmt: skip
        self.command, self.env, self.nproc = command, env, nproc
        self.max_restarts, self.preexec_fn = max_restarts, preexec_fn
        self.restarts = 0
        self.signalled = False  # a signal was passed on: whatever follows is no failure to retry
        self.procs: list[subprocess.Popen | warm_client.Rank] = []
        self._start()

    def _start(self) -> None:
        port = free_port()
        self._oom_kills = memory.oom_kills()
        self.procs = [self._process(rank, port) for rank in range(self.nproc)]
        forked = [p.pid for p in self.procs if isinstance(p, warm_client.Rank)]
        if forked:
            log.info("%d of %d rank(s) forked warm by the warm server (pids %s)", len(forked),
                     self.nproc, ", ".join(map(str, forked)))  # fmt: skip

    def _process(self, rank: int, port: int) -> subprocess.Popen | warm_client.Rank:
        """Local rank ``rank``: forked by the warm server when one serves this machine
        (:mod:`ddppipe.launching.warm`), else started cold."""
        env = rank_environment(self.env, rank, self.nproc, port, self.restarts)
        return warm_client.spawn(self.command, env) or subprocess.Popen(
            self.command, env=env, start_new_session=True, preexec_fn=self.preexec_fn
        )

    def poll(self) -> int | None:
        return None if any(p.poll() is None for p in self.procs) else 0

    def send_signal(self, signum: int) -> None:
        self.signalled = True
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signum)

    def wait(self) -> int:
        """Wait for the group (restarting it after a failure while restarts are left)."""
        while True:
            status = self._wait_once()
            if status in (0, preemption.EXIT_CODE) or self.signalled:
                return status
            if self.restarts >= self.max_restarts or self._deterministic():
                return status
            self.restarts += 1
            log.warning("a worker failed (exit %d): restart %d of %d of the worker group",
                        status, self.restarts, self.max_restarts)  # fmt: skip
            self._start()

    def _deterministic(self) -> bool:
        """Did this start fail for good: a non-finite loss, or the same failure as the start
        before it (the ranks' records, :mod:`ddppipe.runstate.failures`)?"""
        found = slot.read(self.env)
        folder = StateDir(Path(found.state)).failures if found else None
        now = failures.first_of_restart(folder, self.restarts) if folder else None
        if now is None:
            return False
        before = failures.first_of_restart(folder, self.restarts - 1) if self.restarts else None
        final = restarts.ends_run(now, before, self.restarts + 1, "starts")
        if final is not None:
            log.error("not restarting the worker group: %s (%s)", now.cause(), final)
            return True
        return False

    def _wait_once(self) -> int:
        while True:
            codes = [p.poll() for p in self.procs]
            failed = [c for c in codes if c not in (None, 0, preemption.EXIT_CODE)]
            if failed:
                rank = codes.index(failed[0])
                if not self.signalled:
                    self._record_killed(codes)
                log.error("worker of rank %d exited %d: stopping the others", rank,
                          exit_status(failed[0]))  # fmt: skip
                self._stop_survivors()
                return exit_status(failed[0])
            if all(c is not None for c in codes):
                return preemption.EXIT_CODE if preemption.EXIT_CODE in codes else 0
            time.sleep(POLL_S)

    def _record_killed(self, codes: list[int | None]) -> None:
        """Record each worker that a signal killed (the group sent none): its rank, signal
        and step (its heartbeat's), and whether the OOM killer killed it."""
        found = slot.read(self.env)
        if found is None:
            return
        state = StateDir(Path(found.state))
        now, before = memory.oom_kills(), self._oom_kills
        oom = now is not None and before is not None and now > before
        for rank, code in enumerate(codes):
            if code is not None and code < 0:
                local = node_beats.local_folder(found.launcher, node_beats.node())
                beat = heartbeat.Beat.read(heartbeat.beat_file(local, rank))
                step = beat.step if beat and beat.phase == heartbeat.STEP else None
                failures.killed(state.failures, rank, -code, self.restarts, step, oom_killer=oom)

    def _stop_survivors(self) -> None:
        running = [p for p in self.procs if p.poll() is None]
        for p in running:
            p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for p in running:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
