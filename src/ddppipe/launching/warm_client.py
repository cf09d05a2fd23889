"""Warm ranks, the launcher's side: whether the warm server (:mod:`ddppipe.launching.warm`) can
fork a command, a rank it forked (with the part of :class:`subprocess.Popen`'s interface a
worker group uses), and a ``ddppipe`` subcommand run in a process it forked."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ddppipe.core import env_names, system
from ddppipe.launching.warm import SERVED

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 120.0
_POLL_S = 0.05  # between looks for a starting server's socket


def usable(command: list[str], env: Mapping[str, str], wait: bool = True) -> bool:
    """Whether ``command`` may be forked by the server ``env`` names: ``python -m MODULE ...``
    of this interpreter, and a server listening on this machine (``wait``: waited for while
    it starts)."""
    path = env.get(env_names.WARM_SOCKET)
    if not path or len(command) < 3 or command[0] != sys.executable or command[1] != "-m":
        return False
    if command[2] not in SERVED:
        return False
    return _listening(Path(path), env.get(env_names.WARM_SERVER) if wait else None)


def _listening(path: Path, server: str | None) -> bool:
    """Whether a server listens on ``path``; while its process ``server`` lives and has not
    bound it yet (it imports torch first), wait for it. A server that died while importing
    (a zombie until the call that started it ends) is seen within :data:`_POLL_S`: the
    rank starts cold at once, not after :data:`READY_TIMEOUT_S`."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not path.is_socket():
        alive = server is not None and server.isdigit() and system.process_alive(int(server))
        if not alive or time.monotonic() > deadline:
            return False
        time.sleep(_POLL_S)
    return True


class Rank:
    """A rank forked by the server, with the part of :class:`subprocess.Popen`'s interface
    a worker group uses (``pid``, ``poll``, ``wait``, ``send_signal``, ``kill``)."""

    def __init__(self, command: list[str], env: dict[str, str]) -> None:
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._conn.connect(env[env_names.WARM_SOCKET])
        request = {
            "module": command[2], "args": command[3:], "env": env, "cwd": os.getcwd(),
            "cpus": sorted(os.sched_getaffinity(0)), "nice": os.getpriority(os.PRIO_PROCESS, 0),
        }  # fmt: skip
        socket.send_fds(self._conn, [json.dumps(request).encode()], [0, 1, 2])
        self._buffer = b""
        answer = self._message(None)
        assert answer is not None  # (no timeout: a message, or the server's end)
        if "refused" in answer:
            raise ValueError(f"the warm server refused the rank: {answer['refused']}")
        if "pid" not in answer:
            raise OSError("the warm server ended before it forked the rank")
        self.pid: int = answer["pid"]
        self.returncode: int | None = None

    def _message(self, timeout: float | None) -> dict[str, Any] | None:
        """The server's next message, or None when none came within ``timeout`` seconds."""
        while b"\n" not in self._buffer:
            self._conn.settimeout(timeout)
            try:
                chunk = self._conn.recv(4096)
            except (TimeoutError, BlockingIOError):
                return None
            if not chunk:  # the server went away: the rank with it
                return {"exit": -signal.SIGKILL}
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def poll(self) -> int | None:
        if self.returncode is None:
            message = self._message(0)
            if message is not None:
                self._ended(message["exit"])
        return self.returncode

    def _ended(self, code: int) -> None:
        self.returncode = code  # Popen's convention: -N for a rank killed by signal N
        self._conn.close()

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(["warm rank", str(self.pid)], timeout or 0)
            message = self._message(None if left is None else min(left, 1.0))
            if message is not None:
                self._ended(message["exit"])
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def delegate(argv: list[str], wait: bool = True) -> int | None:
    """Run ``ddppipe ARGV`` in a process forked by this machine's server (its imports done):
    its exit status, passing signals on; None when no server serves it (run it here), or
    (``wait`` False) none listens yet."""
    if os.environ.get(env_names.WARM_CHILD):
        return None
    command = [sys.executable, "-m", "ddppipe", *argv]
    child = spawn(command, {**os.environ, env_names.WARM_CHILD: "1"}, wait)
    if child is None:
        return None
    forwarded = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
    previous = {s: signal.signal(s, lambda n, f: child.send_signal(n)) for s in forwarded}
    try:
        code = child.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return code if code >= 0 else 128 - code


def spawn(command: list[str], env: dict[str, str], wait: bool = True) -> Rank | None:
    """A rank forked by the server when it can serve ``command`` (``wait``: waiting while it
    starts); None to start it cold."""
    if not usable(command, env, wait):
        return None
    try:
        return Rank(command, env)
    except (OSError, ValueError, KeyError) as e:
        log.warning("warm server unusable (%s): the rank starts cold", e)
        return None
