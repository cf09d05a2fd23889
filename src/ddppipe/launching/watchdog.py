"""The progress watchdog of a slot: a rank without progress ends the slot as ``hung``.

The launcher (on the job's first node) reads one record a node every
:data:`~ddppipe.launching.node_records.READ_S`: each node's agent (locally the launcher itself)
reads its ranks' heartbeats (:mod:`ddppipe.training.measuring.heartbeat`) node-locally and
judges them (:mod:`ddppipe.training.measuring.node_summary`), reporting at once a rank past its
allowance; a rank never reported is judged here, from the slot's start, and so is a rank whose
node's record stopped (its agent gone) from the record's last change. A rank may go
without progress for its phase's allowance (:func:`allowances.allowance`): a training step's
is ``launch.hang_timeout_s``, or with ``auto`` 10 times the slowest step seen in the slot and
at least 2 minutes (10 minutes until the slot's first steps: torchtitan's two timeouts,
NVIDIA's resiliency extension's timeouts from observed step times); start-up, data,
evaluation, an epoch's start and checkpoints have longer ones of their own, an epoch's start
and an evaluation after their first in the slot 10 times the longest the slot measured.
When a rank exceeds it, the watchdog has every rank write its Python stack (the heartbeat's
signal: ``kill`` locally, ``scancel --signal`` of the srun step on SLURM, which reaches every
node and the ranks' DataLoader workers), names the ranks that did not progress, the frame
each is in and the allowance it exceeded, writes it all to the state folder's
``hangs/attempt-N.txt`` and the log, and kills the ranks. The life cycle records the outcome
``hung`` (ddppipe.launching.lifecycle): on SLURM the job continues from the last checkpoint in
a new slot (ddppipe.launching.slot_machine.decide caps slots that hung without progress).

A script's ranks are watched from their first ``job.should_stop()`` or ``job.log()`` call; a
script that calls neither has no watchdog, and the log and attempt record say so.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddppipe.core import env_names, slot
from ddppipe.launching.node_records import READ_S, NodeRecords
from ddppipe.runstate.state import StateDir
from ddppipe.settings.run_spec import RunSpec
from ddppipe.slurm import scancel as ddp_scancel
from ddppipe.slurm import squeue
from ddppipe.training.measuring import allowances, heartbeat, node_summary

log = logging.getLogger(__name__)

POLL_S = READ_S  # (each poll reads the nodes' records)
DUMP_WAIT_S = 5.0  # for every rank's stack to arrive
KILL_WAIT_S = 15.0  # for the killed step's srun to exit
# A node's record silent this long beyond a rank's allowance: its agent is gone, the rank late.
SILENT_RECORD_S = 2 * node_summary.REPORT_S
NO_WATCHDOG_NOTE = (
    "no hang watchdog: the script called neither job.should_stop() nor job.log(), through "
    "which the watchdog sees its progress"
)
# A rank whose innermost frame is here waits for the others (a collective, DDP's gradient
# all-reduce in the backward): it is not where a hang started.
WAITING_IN = ("/torch/distributed/", "/torch/nn/parallel/distributed.py", "/torch/autograd/",
              "/torch/_tensor.py")  # fmt: skip


# -- stacks ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    function: str

    def __str__(self) -> str:
        """``function at path:line``, the path relative to the working directory inside it."""
        path = os.path.relpath(self.file) if os.path.isabs(self.file) else self.file
        return f"{self.function} at {self.file if path.startswith('..') else path}:{self.line}"


_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-fA-F]+)")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')


def parse_stacks(text: str) -> dict[int, list[Frame]]:
    """faulthandler's dump of every thread: each thread's frames, innermost first (a thread
    dumped twice keeps its last dump)."""
    threads: dict[int, list[Frame]] = {}
    current: list[Frame] | None = None
    for line in text.splitlines():
        if match := _THREAD.match(line):
            current = threads[int(match[1], 16)] = []
        elif current is not None and (match := _FRAME.match(line)):
            current.append(Frame(match[1], int(match[2]), match[3]))
    return threads


def waiting(frames: list[Frame]) -> bool:
    """Is a rank with these frames (innermost first) waiting for the other ranks?"""
    return bool(frames) and any(part in frames[0].file for part in WAITING_IN)


def where(frames: list[Frame], user_file: str | None) -> Frame | None:
    """The innermost frame in the user's file when there is one, else the innermost."""
    if user_file:
        mine = [f for f in frames if _same_file(f.file, user_file)]
        if mine:
            return mine[0]
    return frames[0] if frames else None


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)


@dataclass
class RankView:
    """What the watchdog knows of one rank."""

    rank: int
    beat: heartbeat.Beat | None = None
    changed_at: float = 0.0  # the launcher's time.monotonic() of its last progress
    frames: list[Frame] = field(default_factory=list)
    reported: bool = False  # in a node's record (its agent judges it), else judged here
    node: str = ""  # whose record reported it
    late: bool = False  # past its allowance, its node's agent says

    @property
    def phase(self) -> str:
        return self.beat.phase if self.beat else "start-up"

    def describe(self, now: float) -> str:
        host = self.beat.host if self.beat else "?"
        step = f", step {self.beat.step}" if self.beat and self.beat.step is not None else ""
        return f"rank {self.rank} ({host}): {self.phase}{step}, {now - self.changed_at:.0f} s idle"


@dataclass(frozen=True)
class Hang:
    """A slot that hung: the ranks that did not progress and where each was."""

    ranks: list[int]
    places: dict[int, str]  # rank -> "function at file:line" (the user's frame if any)
    hosts: dict[int, str]
    phase: str
    idle_s: float
    allowance_s: float
    allowance: str  # which allowance it was, in words (allowances.Allowance.why)
    stacks: str  # the report's path

    @property
    def detail(self) -> str:
        """One line for the attempt history and the summary."""
        named = "; ".join(
            f"rank {r} ({self.hosts.get(r, '?')}) in {self.places.get(r, 'an unknown frame')}"
            for r in self.ranks
        )
        return (
            f"{named}: no progress in {self.phase} for {self.idle_s:.0f} s (allowed "
            f"{self.allowance_s:.0f} s, {self.allowance}); every rank's stack: {self.stacks}"
        )

    def as_dict(self) -> dict[str, Any]:
        return {"ranks": self.ranks, "places": {str(k): v for k, v in self.places.items()},
                "detail": self.detail, "stacks": self.stacks}  # fmt: skip


class Watchdog:
    """Watches one slot's ranks from the launcher; see the module's docstring. ``world_size``:
    the slot's ranks (None: the run's, ``spec.world_size``; fewer after a node failure,
    ``slurm.min_nodes``)."""

    def __init__(self, spec: RunSpec, state: StateDir, attempt: int, job: str | None,
                 world_size: int | None = None) -> None:  # fmt: skip
        self.state, self.folder = state, state.watchdog
        self.report = state.hangs / f"attempt-{attempt}.txt"
        self.setting, self.nodes = spec.launch.hang_timeout_s, spec.launch.nnodes
        self.world_size = spec.world_size if world_size is None else world_size
        self.script, self.gpus, self.job = spec.kind == "script", spec.gpus, job
        source = spec.task_source or {}
        self.user_file = source.get("path") if source.get("path") else None
        self.views = {r: RankView(r) for r in range(self.world_size)}
        self.hang: Hang | None = None
        self.armed_at: float | None = None
        self.records: NodeRecords | None = None  # the nodes' records (the node watch's too)
        self._applied: dict[str, int] = {}  # node -> the count of its record read into views
        self._end_local: Callable[[], None] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def environment(self) -> dict[str, str]:
        """An empty watchdog folder for the slot, the reader of its nodes' records (the slot
        record's launcher), and what its nodes' agents and torch need to know of it."""
        shutil.rmtree(self.folder, ignore_errors=True)
        self.folder.mkdir(parents=True, exist_ok=True)
        found = self._slot()
        self.records = NodeRecords(self.state.node_beats, found.launcher if found else "")
        env = {env_names.HANG_TIMEOUT: str(self.setting), env_names.RUN_NODES: str(self.nodes)}
        if self.gpus:  # the NCCL flight recorder: kept, dumped on NCCL's timeout or on a hang
            env.update({
                "TORCH_NCCL_TRACE_BUFFER_SIZE": os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE")
                or "2000",  # (a user's own size wins)
                "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(self.folder.resolve() / "nccl-trace-rank-"),
            })  # fmt: skip
        return env

    def start(self, end: Callable[[list[heartbeat.Beat]], None],
              local_pids: Callable[[], list[int]]) -> None:  # fmt: skip
        """Watch in a thread; on a hang, dump the stacks and call ``end`` (kills the ranks).
        ``local_pids``: the launcher's own children, signalled where no heartbeat names one."""
        self._end, self._local_pids = end, local_pids
        found = self._slot()
        if self.records is None:
            self.records = NodeRecords(self.state.node_beats, found.launcher if found else "")
        if self.job is None and found is not None:  # locally: this node's agent is this process
            self._end_local = node_summary.start_for(found, self.setting, self.nodes)
        now = time.monotonic()
        self.records.started = now
        for view in self.views.values():
            view.changed_at = now
        self._thread = threading.Thread(target=self._run, name="ddppipe-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=DUMP_WAIT_S + KILL_WAIT_S + 10)
        if self._end_local is not None:
            self._end_local()
            self._end_local = None
        self._read(time.monotonic(), force=True)  # the last beats (a short script's first call)

    def beats(self) -> list[heartbeat.Beat]:
        """Every rank's last heartbeat, its node's record read now (none from a rank before
        its first)."""
        self._read(time.monotonic(), force=True)
        return [v.beat for v in self.views.values() if v.beat is not None]

    def _slot(self) -> slot.Slot | None:
        """The slot record as the launcher wrote it (read afresh: a job's next slot rewrites
        it)."""
        try:
            return slot.Slot(**json.loads(self.state.slot.read_text()))
        except (OSError, ValueError, TypeError):
            return None

    @property
    def watched(self) -> bool:
        """Did the watchdog watch this slot's ranks (a script: did it call the job API)?"""
        return not self.script or self.armed_at is not None

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                late = self._check(time.monotonic())
                if late is not None:
                    self._handle(*late)
                    return
            except Exception:  # never let the watchdog take the slot down
                log.exception("hang watchdog failed; the slot goes on unwatched")
                return

    def _read(self, now: float, force: bool = False) -> None:
        """The nodes' records (at most every READ_S unless ``force``): each rank's last beat,
        its progress (the launcher's time of the record less its idle seconds), whether its
        node's agent judged it late, and the arming."""
        if self.records is None:
            return
        self.records.update(now, force)
        for node, record in self.records.records.items():
            if self._applied.get(node) == record.count:
                continue
            self._applied[node] = record.count
            seen_at = self.records.changed_at[node]
            for fields in record.ranks:
                fields = dict(fields)
                idle, late = float(fields.pop("idle_s", 0.0)), bool(fields.pop("late", False))
                try:
                    beat = heartbeat.Beat(**fields)
                except TypeError:
                    continue
                view = self.views.get(beat.rank)
                if view is None:
                    continue
                view.beat, view.reported, view.late, view.node = beat, True, late, node
                view.changed_at = seen_at - idle
                if self.armed_at is None and beat.watched:
                    self.armed_at = seen_at
        if self.records.listing and all(v.reported for v in self.views.values()):
            self.records.listing = False  # every rank's node known: no more listing

    def _check(self, now: float) -> tuple[list[RankView], allowances.Allowance] | None:
        """Read the heartbeats; the ranks past their allowance (and it) if any."""
        self._read(now)
        if not self.watched:
            return None
        late: list[RankView] = []
        allowed: allowances.Allowance | None = None
        for view in self.views.values():
            if view.phase == heartbeat.DONE:
                continue
            beat = view.beat
            longest = (beat.longest_s or {}).get(view.phase) if beat else None
            limit = allowances.allowance(
                self.setting,
                view.phase,
                beat.slowest_step_s if beat else None,
                longest,
                self.nodes,
            )
            since, grace = max(view.changed_at, self.armed_at or view.changed_at), 0.0
            if view.reported:  # its node's agent judges it, unless its record fell silent
                heard = self.records.changed_at.get(view.node, now) if self.records else now
                since, grace = max(heard, self.armed_at or heard), SILENT_RECORD_S
            if view.late or now - since > limit.seconds + grace:
                late.append(view)
                allowed = limit if allowed is None or limit.seconds > allowed.seconds else allowed
        return (late, allowed) if late and allowed is not None else None

    # -- a hang ------------------------------------------------------------------------------

    def _handle(self, late: list[RankView], allowed: allowances.Allowance) -> None:
        now = time.monotonic()
        log.error(
            "hang watchdog: no progress from %s (allowed %.0f s): recording every rank's stack",
            ", ".join(v.describe(now) for v in late), allowed.seconds,
        )  # fmt: skip
        beats = [v.beat for v in self.views.values() if v.beat is not None]
        self._dump(beats)
        culprits = self._culprits(late)
        self.report.parent.mkdir(parents=True, exist_ok=True)
        text = self._report(now, allowed.seconds)
        self.report.write_text(text)
        self.hang = Hang(
            ranks=[v.rank for v in culprits],
            places={v.rank: str(f) for v in culprits if (f := where(v.frames, self.user_file))},
            hosts={v.rank: v.beat.host for v in culprits if v.beat},
            phase=late[0].phase, idle_s=now - min(v.changed_at for v in late),
            allowance_s=allowed.seconds, allowance=allowed.why, stacks=str(self.report),
        )  # fmt: skip
        log.error("hang watchdog: the slot hung: %s\n%s", self.hang.detail, text)
        self._end(beats)

    def _dump(self, beats: list[heartbeat.Beat]) -> None:
        """Every rank's stack into its stacks file: the heartbeat's signal to each rank (each
        node's agent copies the dumps into the state folder; a GPU rank then dumps its NCCL
        flight recorder there too)."""
        if self.job is None:
            named = {b.pid for b in beats if b.host == socket.gethostname()}
            pids = named if len(named) == self.world_size else named | set(self._local_pids())
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, heartbeat.DUMP_SIGNAL)
        else:
            for step in steps(self.job, beats):
                scancel(step, heartbeat.DUMP_SIGNAL)
        deadline = time.monotonic() + DUMP_WAIT_S
        sizes: dict[int, int] = {}
        alive = [v.rank for v in self.views.values() if v.phase != heartbeat.DONE]
        while time.monotonic() < deadline:
            time.sleep(0.2)
            now_sizes = {r: _size(heartbeat.stacks_file(self.folder, r)) for r in alive}
            if all(now_sizes.values()) and now_sizes == sizes:
                break  # every rank wrote, and nothing grew in the last 0.2 s
            sizes = now_sizes
        for view in self.views.values():
            path = heartbeat.stacks_file(self.folder, view.rank)
            try:
                threads = parse_stacks(path.read_text(errors="replace"))
            except OSError:
                threads = {}
            main = view.beat.thread if view.beat else None
            view.frames = threads.get(main, []) if main in threads else next(
                iter(threads.values()), []
            )  # fmt: skip

    def _culprits(self, late: list[RankView]) -> list[RankView]:
        """The ranks that did not progress and are not waiting for the others: those whose
        stack is outside a collective, else those a step behind, else every late rank."""
        dumped = [v for v in self.views.values() if v.frames]
        working = [v for v in dumped if not waiting(v.frames)]
        if working and len(working) < len(self.views):
            return working
        reached = {v.rank: v.beat.step for v in self.views.values() if v.beat}
        if None not in reached.values() and len(reached) == len(self.views):
            least = min(reached.values())  # type: ignore[type-var]
            if least != max(reached.values()):  # type: ignore[type-var]
                return [self.views[r] for r, step in reached.items() if step == least]
        return working or late

    def _report(self, now: float, allowed: float) -> str:
        """Every rank's state and main-thread stack (innermost last, as Python prints)."""
        parts = [f"hang watchdog: a slot without progress (allowed {allowed:.0f} s)"]
        for view in self.views.values():
            pid = f", pid {view.beat.pid}" if view.beat else ""
            parts.append(f"\n{view.describe(now)}{pid}")
            if view.phase == heartbeat.DONE:
                parts.append("  (its process had ended)")
            elif not view.frames:
                parts.append("  (no stack: the rank did not answer)")
            for frame in reversed(view.frames):
                parts.append(f'  File "{frame.file}", line {frame.line}, in {frame.function}')
        return "\n".join(parts) + "\n"


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def steps(job: str, beats: list[heartbeat.Beat]) -> list[str]:
    """The srun steps of ``job`` the ranks run in (from their heartbeats, else squeue's)."""
    named = sorted({b.slurm_step for b in beats if b.slurm_step})
    if named:
        return named
    return squeue.steps(job)


def scancel(step: str, sig: signal.Signals) -> None:
    """``sig`` to every process of the SLURM step ``step`` (JOB.STEP), on every node."""
    error = ddp_scancel.send(step, sig)
    if error is not None:
        log.warning("scancel --signal=%s %s failed: %s", sig.name, step, error)
