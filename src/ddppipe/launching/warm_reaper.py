"""The warm server's ranks' ends told to their launchers (:mod:`ddppipe.launching.warm`): one
reaper at a time, the server's loop, or a thread while the server imports; never a signal
handler (one runs inside whatever the server runs, where a second signal re-entered it)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
from collections.abc import Iterator

log = logging.getLogger(__name__)

POLL_S = 0.05  # how soon a rank's end is told: the server loop's wait, the thread's


@contextlib.contextmanager
def reaping(ranks: dict[int, socket.socket]) -> Iterator[None]:
    """While the server imports or loads (seconds it runs no loop), a rank's end is still told
    to its launcher within :data:`POLL_S` (a delegated command's caller, a run's config check,
    waits for it): a thread reaps meanwhile, the only reaper then. No SIGCHLD handler: one
    runs inside whatever the server runs (an import), where a second signal re-entered it and
    its error killed the server mid-import. The thread is gone before the loop goes on (the
    server forks no rank while a thread of its own runs)."""
    done = threading.Event()

    def reap_until_done() -> None:
        while not done.wait(POLL_S):
            reap(ranks)

    reaper = threading.Thread(target=reap_until_done, name="warm-reaper", daemon=True)
    reaper.start()
    try:
        yield
    finally:
        done.set()
        reaper.join()
    reap(ranks)


def reap(ranks: dict[int, socket.socket]) -> None:
    """Tell each launcher whose rank ended its exit status (a shell's: 128 + N for signal N).
    Only the server's ranks are waited for (a process an import or a task's code started is
    its own to wait for); one waited for elsewhere (a task's code in the server) has lost its
    status: told as failed (1), never as a success."""
    for pid in list(ranks):
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            log.warning("warm server: rank %d was waited for by other code in the server, its "
                        "exit status lost: told to its launcher as 1 (failed)", pid)  # fmt: skip
            done, status = pid, None
        if done == 0:
            continue
        conn = ranks.pop(pid, None)
        if conn is None:  # (told already)
            continue
        code = 1 if status is None else os.waitstatus_to_exitcode(status)  # -N: signal N
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps({"exit": code}).encode() + b"\n")
        conn.close()
