"""A node's summary of its ranks: one record a node for the launcher, not one file a rank.

The node's agent (``ddppipe agent`` on SLURM; locally the launcher itself, the same code) reads
its ranks' heartbeats every :data:`POLL_S` from the slot's node-local folder (memory: nothing
on the shared filesystem, :mod:`ddppipe.training.measuring.heartbeat`). It judges each rank as
the watchdog would (:func:`ddppipe.training.measuring.allowances.allowance` of its phase,
measured in the agent's clock from its last progress) and reports its node in one small record
(:class:`ddppipe.runstate.node_beats.NodeRecord`) in the run's state folder: at once when a rank
falls past its allowance or comes back, when a rank appears or the node's first rank is
watched, and otherwise every :data:`REPORT_S` (its sign of life for the node watch). It copies
a rank's stack dump (written node-locally on the launcher's signal) to the state folder's
``watchdog/rank-N.stacks`` once it is whole. The shared filesystem sees one in-place write a
node every few seconds, whatever the ranks a node.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from ddppipe.core import env_names, slot
from ddppipe.runstate import node_beats
from ddppipe.runstate.state import StateDir
from ddppipe.training.measuring import allowances, heartbeat

POLL_S = 0.5  # the node-local reads (memory)
REPORT_S = 5.0  # a node's record, without news: its sign of life


def hang_setting(env: dict[str, str] | None = None) -> float | str:
    """``launch.hang_timeout_s`` as the launcher passed it (``auto`` without it)."""
    value = (os.environ if env is None else env).get(env_names.HANG_TIMEOUT, "auto")
    try:
        return float(value)
    except ValueError:
        return "auto"


def run_nodes(env: dict[str, str] | None = None) -> int:
    """``launch.nnodes`` as the launcher passed it (1 without it)."""
    value = (os.environ if env is None else env).get(env_names.RUN_NODES, "1")
    return int(value) if value.isdigit() and int(value) > 0 else 1


@dataclass
class _Rank:
    beat: heartbeat.Beat
    changed_at: float  # the agent's time.monotonic() of its last progress
    stacks_size: int = 0  # its stack dump's size at the last poll
    copied: int = 0  # the size copied to the state folder


class Summary:
    """One node's summary of slot ``launcher``'s ranks in ``local`` (node-local), reported to
    ``shared`` (the state folder); ``setting``: ``launch.hang_timeout_s``; ``nodes``: the run's
    (``launch.nnodes``: start-up's allowance grows with them)."""

    def __init__(self, launcher: str, node: str, local: Path, shared: StateDir,
                 setting: float | str, now: float | None = None,
                 nodes: int = 1) -> None:  # fmt: skip
        self.launcher, self.node, self.local, self.setting = launcher, node, local, setting
        self.nodes = nodes
        self.path, self.stacks = shared.node_beats / node, shared.watchdog
        self.started = time.monotonic() if now is None else now
        self.ranks: dict[int, _Rank] = {}
        self.armed_at: float | None = None
        self.count, self.size, self.written_at = 0, 0, None
        self._reported: tuple = ()
        self.writes = 0

    def poll(self, now: float) -> None:
        """Read the node's beats (a change is progress) and copy whole stack dumps."""
        for path in sorted(self.local.glob("rank-*.json")):
            beat = heartbeat.Beat.read(path)
            if beat is None:
                continue
            seen = self.ranks.get(beat.rank)
            if seen is None:
                seen = self.ranks[beat.rank] = _Rank(beat, now)
            elif (beat.count, beat.pid) != (seen.beat.count, seen.beat.pid):
                seen.changed_at = now
            seen.beat = beat
            if self.armed_at is None and beat.watched:
                self.armed_at = now
            self._copy_stacks(seen)

    def _copy_stacks(self, seen: _Rank) -> None:
        """A rank's node-local stack dump, copied once it stopped growing (written once)."""
        local = heartbeat.stacks_file(self.local, seen.beat.rank)
        try:
            size = local.stat().st_size
        except OSError:
            return
        if size and size == seen.stacks_size and size != seen.copied:
            with contextlib.suppress(OSError):
                self.stacks.mkdir(parents=True, exist_ok=True)
                heartbeat.stacks_file(self.stacks, seen.beat.rank).write_bytes(local.read_bytes())
                seen.copied = size
        seen.stacks_size = size

    def idle(self, rank: int, now: float) -> float:
        """Seconds ``rank`` went without progress, counted from the node's arming."""
        seen = self.ranks[rank]
        return now - max(seen.changed_at, self.armed_at or seen.changed_at)

    def late(self, rank: int, now: float) -> bool:
        """Is ``rank`` past its phase's allowance (a watched node, a rank not done)?"""
        beat = self.ranks[rank].beat
        if self.armed_at is None or beat.phase == heartbeat.DONE:
            return False
        longest = (beat.longest_s or {}).get(beat.phase)
        limit = allowances.allowance(self.setting, beat.phase, beat.slowest_step_s, longest,
                                     self.nodes)  # fmt: skip
        return self.idle(rank, now) > limit.seconds

    def record(self, now: float, ended: bool = False) -> node_beats.NodeRecord:
        ranks = [
            {**asdict(seen.beat), "idle_s": round(self.idle(rank, now), 3),
             "late": self.late(rank, now)}
            for rank, seen in sorted(self.ranks.items())
        ]  # fmt: skip
        return node_beats.NodeRecord(self.launcher, self.node, self.count, ended, ranks)

    def news(self, now: float) -> tuple:
        """What, when it changes, is reported at once: the ranks, which are late, the arming."""
        late = tuple(r for r in sorted(self.ranks) if self.late(r, now))
        return tuple(sorted(self.ranks)), late, self.armed_at is not None

    def due(self, now: float) -> bool:
        """Is a record due: news, or :data:`REPORT_S` since the last?"""
        if self.written_at is None or now - self.written_at >= REPORT_S:
            return True
        return self.news(now) != self._reported

    def report(self, now: float, ended: bool = False) -> None:
        """Write the node's record (its count one up)."""
        if self.written_at is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.count += 1
        self._reported = self.news(now)
        self.size = self.record(now, ended).write(self.path, self.size) or self.size
        self.written_at = now
        self.writes += 1

    def step(self, now: float) -> None:
        """One poll, and the record if one is due."""
        self.poll(now)
        if self.due(now):
            self.report(now)


def run(summary: Summary) -> Callable[[], None]:
    """Summarise in a background thread; the function that stops it, reports the node ended
    and removes the node-local folder."""
    stop = threading.Event()
    summary.report(time.monotonic())  # the first at once: the node lives

    def loop() -> None:
        while not stop.wait(POLL_S):
            summary.step(time.monotonic())

    thread = threading.Thread(target=loop, name="ddppipe-node-summary", daemon=True)
    thread.start()

    def end() -> None:
        stop.set()
        thread.join(timeout=5)
        now = time.monotonic()
        summary.poll(now)  # (the ranks' last beats: a short script's first job call)
        summary.report(now, ended=True)
        shutil.rmtree(summary.local, ignore_errors=True)

    return end


def start() -> Callable[[], None]:
    """(A node's agent) Summarise this node's ranks of the current slot (its record's,
    :mod:`ddppipe.core.slot`) by the launcher's ``launch.hang_timeout_s`` and ``launch.nnodes``
    (:func:`hang_setting`, :func:`run_nodes`); the function that ends it. Outside a slot:
    nothing."""
    found = slot.read()
    if found is None:
        return lambda: None
    return start_for(found, hang_setting(), run_nodes())


def start_for(found: slot.Slot, setting: float | str, nodes: int) -> Callable[[], None]:
    """:func:`start` for slot record ``found``, ``setting`` and ``nodes`` (locally: the
    launcher's own)."""
    node = node_beats.node()
    local = node_beats.local_folder(found.launcher, node)
    node_beats.make_local_folder(local)
    state = StateDir(Path(found.state))
    return run(Summary(found.launcher, node, local, state, setting, nodes=nodes))
