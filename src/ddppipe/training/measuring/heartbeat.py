"""A rank's heartbeat: its progress, for the launcher's watchdog (ddppipe.launching.watchdog).

Every rank says what it is doing (its phase: start-up, data, train, evaluate, checkpoint) and
which step it reached with :func:`beat`, a few attribute updates on the training's own
thread (the loop calls it every step). A thread of the rank writes that to its node, never to
the shared filesystem: ``rank-N.json`` in the slot's node-local folder
(:func:`ddppipe.runstate.node_beats.local_folder`, in memory), one small in-place write at
most every :data:`WRITE_EVERY_S` and only on change. The node's agent reads its ranks there and
reports them in one record a node (ddppipe.training.measuring.node_summary), which the
launcher's watchdog reads. A rank that hangs stops beating; the launcher then sends
:data:`DUMP_SIGNAL`, on which ``faulthandler`` (C code, no GIL needed) writes every thread's
Python stack to the node-local ``rank-N.stacks``, even where the rank is blocked inside C; the
node's agent copies it to the run's state folder (``watchdog/rank-N.stacks``), once. On GPU
runs this thread then dumps the NCCL flight recorder there too (the stacks written are the
launcher's request).

No torch import: :func:`start` runs first thing in a rank, before torch loads.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import json
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ddppipe.core import in_place, slot
from ddppipe.runstate import node_beats
from ddppipe.runstate.state import StateDir

# Ignored by default, so nothing else of a job dies of it: torchrun's agents, srun, a
# DataLoader's workers (which unregister it after the fork), the batch script.
DUMP_SIGNAL = signal.SIGWINCH
STEP = "train"  # the phase of training steps (a script: between its job API calls)
EPOCH_START = "epoch-start"  # an epoch's start: until its loader's first batch
DONE = "done"  # the rank's process ends: never late
PHASES = ("start-up", "data", EPOCH_START, STEP, "evaluate", "checkpoint", DONE)
WRITE_EVERY_S = 0.5  # (to the node-local folder: in memory)
RECORD_BYTES = 512  # records are padded to this, so a shorter one overwrites a longer one


def beat_file(folder: Path, rank: int) -> Path:
    return Path(folder) / f"rank-{rank}.json"


def stacks_file(folder: Path, rank: int) -> Path:
    return Path(folder) / f"rank-{rank}.stacks"


@dataclass(frozen=True)
class Beat:
    """What a rank's heartbeat file says."""

    rank: int
    host: str
    pid: int
    thread: int  # the main thread's id, as faulthandler prints it
    phase: str
    step: int | None  # the step it started last (global for a task, a script's own number)
    count: int  # beats so far: a change is progress
    slowest_step_s: float | None  # the slowest step of the slot after each phase's first
    watched: bool  # False until a script's first job.should_stop()/job.log() call
    slurm_step: str | None  # "JOB.STEP" of an srun step, None locally
    # each phase the rank left: the longest it went without progress in it (this slot)
    longest_s: dict[str, float] | None = None

    @classmethod
    def read(cls, path: Path) -> Beat | None:
        """The record in ``path``; None when there is none or it cannot be read now."""
        try:
            text = Path(path).read_text()
            record, _ = json.JSONDecoder().raw_decode(text.strip())
            return cls(**record)
        except (OSError, ValueError, TypeError):
            return None


class Heart:
    """This process's heartbeat (one per rank, made by :func:`start`): beats to ``folder``
    (node-local); ``shared``: the slot's watchdog folder, for the NCCL flight recorder's dump
    once ``stacks`` (the descriptor of this rank's stack dump) has one. ``background``: False
    for a caller that writes itself (:meth:`_write`: bench/control_plane.py's ranks)."""

    def __init__(self, folder: Path, rank: int, watched: bool, nccl_trace: bool,
                 shared: Path | None = None, stacks: int | None = None,
                 background: bool = True) -> None:  # fmt: skip
        self.folder, self.rank, self.watched = Path(folder), rank, watched
        self.shared, self._stacks = Path(shared or folder), stacks
        self.phase, self.step, self.count = "start-up", None, 0
        self.at, self.in_phase, self.slowest = time.monotonic(), 0, None
        self.longest: dict[str, float] = {}
        self._written = -1
        job, step = os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURM_STEP_ID")
        self._identity = {
            "rank": rank, "host": socket.gethostname(), "pid": os.getpid(),
            "thread": threading.main_thread().ident,
            "slurm_step": f"{job}.{step}" if job and step else None,
        }  # fmt: skip
        self._nccl_dumped = not nccl_trace or stacks is None
        self._write()
        if background:
            threading.Thread(target=self._run, name="ddppipe-heartbeat", daemon=True).start()

    def beat(self, phase: str, step: int | None = None) -> None:
        now = time.monotonic()
        if phase == self.phase:
            self.in_phase += 1
            # Not a phase's first step: it also starts the data loader, warms caches up.
            if phase == STEP and self.in_phase >= 2:
                interval = now - self.at
                if self.slowest is None or interval > self.slowest:
                    self.slowest = interval
        else:
            gap = now - self.at  # in the phase it leaves (beaten once in a recurring phase)
            if gap > self.longest.get(self.phase, 0.0):
                self.longest[self.phase] = round(gap, 3)
            self.phase, self.in_phase = phase, 0
        self.step, self.at, self.watched = step, now, True
        self.count += 1

    def _record(self) -> bytes:
        record = {**self._identity, "phase": self.phase, "step": self.step, "count": self.count,
                  "slowest_step_s": self.slowest, "watched": self.watched,
                  "longest_s": dict(self.longest)}  # fmt: skip
        return json.dumps(record).encode()

    def _write(self) -> None:
        """One in-place write, then close (core.in_place), to the node-local folder."""
        count, record = self.count, self._record()
        if in_place.write_padded(beat_file(self.folder, self.rank), record, RECORD_BYTES):
            self._written = count

    def _run(self) -> None:
        while True:
            time.sleep(WRITE_EVERY_S)
            if self.count != self._written:
                self._write()
            if not self._nccl_dumped and _size(self._stacks) > 0:  # the launcher asked
                self._nccl_dumped = True
                self._dump_nccl_trace()

    def _dump_nccl_trace(self) -> None:
        """The NCCL flight recorder's entries of this rank (PyTorch's own pickle), if any."""
        torch = sys.modules.get("torch")
        if torch is None:
            return
        c10d = torch._C._distributed_c10d
        dump = getattr(c10d, "_dump_nccl_trace", None) or getattr(c10d, "_dump_fr_trace", None)
        try:
            trace = dump()
        except Exception:  # no NCCL process group, or a torch without the recorder
            return
        with contextlib.suppress(OSError):
            (self.shared / f"rank-{self.rank}.nccl-trace").write_bytes(trace)


def _size(fd: int | None) -> int:
    """The size of open file ``fd`` (0 for none)."""
    if fd is None:
        return 0
    try:
        return os.fstat(fd).st_size
    except OSError:
        return 0


_heart: Heart | None = None
_stacks_fd: int | None = None


def _forget_in_child() -> None:
    """(A forked child: a DataLoader worker) Not a rank: no heartbeat, no stack dump."""
    global _heart
    _heart = None
    faulthandler.unregister(DUMP_SIGNAL)


def start(watched: bool = True) -> None:
    """Start this rank's heartbeat and its stack dump on :data:`DUMP_SIGNAL`, in the
    node-local folder of its slot (its record's); a no-op elsewhere or when started.

    ``watched``: False for a script, whose first job API call arms the watchdog.
    """
    global _heart, _stacks_fd
    found = slot.read()
    if _heart is not None or found is None:
        return
    folder = node_beats.local_folder(found.launcher, node_beats.node())
    if not node_beats.make_local_folder(folder):
        print(f"ddppipe: no heartbeat: {folder} cannot be made (another user's?)", file=sys.stderr)
        return
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    with contextlib.suppress(OSError):
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        _stacks_fd = os.open(stacks_file(folder, rank), flags, 0o644)
        faulthandler.register(DUMP_SIGNAL, file=_stacks_fd, all_threads=True, chain=False)
        os.register_at_fork(after_in_child=_forget_in_child)
    shared = StateDir(Path(found.state)).watchdog
    _heart = Heart(folder, rank, watched, found.nccl_trace, shared, _stacks_fd)
    atexit.register(done)


def done() -> None:
    """This rank's process ends (its last beat, written now): it is no longer watched."""
    if _heart is not None and _heart.phase != DONE:
        _heart.beat(DONE)
        _heart._write()


def beat(phase: str, step: int | None = None) -> None:
    """This rank is in ``phase`` (:data:`PHASES`), starting ``step``: progress."""
    if _heart is not None:
        _heart.beat(phase, step)
