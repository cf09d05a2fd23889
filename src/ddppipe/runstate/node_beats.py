"""Each node's sign of life during a SLURM step, and the nodes that went silent.

A node's ``ddppipe agent`` (torchrun) writes ``node-beats/<node>`` in the state folder
every :data:`BEAT_S` with its slot's launcher and a count, and once more with ``ended`` when
it exits, whatever its exit. The launcher of a job that survives a node failure
(``slurm.spare_nodes``, ``slurm.min_nodes``) reads them: a node whose count stopped changing,
in the launcher's own clock (no clock of two nodes compared; a late filesystem delays a beat,
it never invents one), without ``ended``, is silent: its agent is gone with its node
(:class:`Silence`).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ddppipe.core import in_place, slot
from ddppipe.runstate.state import StateDir

BEAT_S = 1.0  # an agent's beat
ENDED = "ended"
RECORD_BYTES = 128  # a beat's record, padded
NODE_ENV = "SLURMD_NODENAME"  # set by slurmd in every task: the node's SLURM name


def start() -> Callable[[], None]:
    """(A node's agent) Beat in a background thread for this slot (its record's launcher);
    the function that stops it and marks the node's agent ended. Outside a slot: nothing."""
    found = slot.read()
    if found is None:
        return lambda: None
    node = os.environ.get(NODE_ENV) or socket.gethostname()
    path = StateDir(Path(found.state)).node_beats / node
    stop = threading.Event()

    def beat() -> None:
        count = 1
        while not stop.wait(BEAT_S):
            _write(path, f"{found.launcher} {count}")
            count += 1

    path.parent.mkdir(parents=True, exist_ok=True)
    _write(path, f"{found.launcher} 0")  # the first at once

    thread = threading.Thread(target=beat, name="ddppipe-node-beat", daemon=True)
    thread.start()

    def end() -> None:
        stop.set()
        thread.join(timeout=5)
        _write(path, f"{found.launcher} {ENDED}")

    return end


def _write(path: Path, text: str) -> None:
    """One in-place write of ``text``, padded (as a rank's heartbeat: core.in_place)."""
    in_place.write_padded(path, f"{text}\n".encode(), RECORD_BYTES)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


class Silence:
    """(The launcher) How long each node of a step has gone without a beat of its slot
    ``launcher``, in this process's clock from ``started`` (the step's start)."""

    def __init__(self, state: StateDir, launcher: str, hosts: list[str],
                 started: float | None = None) -> None:  # fmt: skip
        self.folder = state.node_beats
        self.launcher = launcher
        since = time.monotonic() if started is None else started
        self.seen: dict[str, tuple[str | None, float]] = {h: (None, since) for h in hosts}
        self.beaten: set[str] = set()  # nodes that beat at least once in this step
        self.ended: set[str] = set()

    def update(self, now: float | None = None) -> None:
        """Read every node's beat file; note when each last changed."""
        now = time.monotonic() if now is None else now
        for node, (last, _) in self.seen.items():
            text = _read(self.folder / node)
            if text is None or not text.startswith(f"{self.launcher} "):
                continue  # none yet, or an earlier step's
            if text.endswith(f" {ENDED}"):
                self.ended.add(node)
            if text != last:
                self.seen[node] = (text, now)
                self.beaten.add(node)

    def silent_for(self, node: str, now: float | None = None) -> float:
        """Seconds since ``node``'s last beat (since the step's start before its first); 0 for
        a node whose agent ended."""
        if node in self.ended:
            return 0.0
        return (time.monotonic() if now is None else now) - self.seen[node][1]
