"""Why a slot failed: each failing rank's record, the first of them, and failures that end a run.

Every rank of a slot that dies of a Python exception leaves one record
(``<state>/failures/restart<R>-rank<N>.json``, written by :func:`record`: the trainer's entry
and ``python -m ddppipe.training.script.run_script`` for a user's script): its rank, node, time,
exception type and message, traceback, the training step it was in, and the innermost frame
in the user's own file (the task file or the script). The launcher reads them when the slot
ends (:func:`first`): the **first** failure by time is the cause; the others (rank 0's gloo
``Connection closed by peer``, a survivor's SIGTERM) follow from it. A rank out of memory
(:mod:`ddppipe.runstate.out_of_memory`) or killed by a signal (recorded by whoever watched it,
:func:`killed`: the rank itself cannot) comes before the others whatever its time. Under
torchrun the same record also goes to ``TORCHELASTIC_ERROR_FILE`` in torch's format, so the
agent's own error table shows the traceback.

A failure ends the run for good (:func:`finalize`, ``<state>/final-failure.json``) when it is
a non-finite loss, or when a slot fails with the same exception, frame and step as the slot
before it: a retried job (SLURM's ``retries``) of the same config then refuses to train in
seconds (:func:`refusal`) instead of training into the same crash again. A change of the
config or of the task file (its SHA-256 is part of the config) lifts it.

No torch here: the launcher reads records without it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import socket
import sys
import sysconfig
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from ddppipe.core import atomic, slot
from ddppipe.core.errors import UserError
from ddppipe.runstate import out_of_memory, outcomes, preemption
from ddppipe.runstate.outcomes import Kind, Outcome
from ddppipe.runstate.state import StateDir
from ddppipe.settings.run_spec import RunSpec

TORCH_ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"  # set by torchrun's agent for each worker
NONFINITE = "NonFiniteLoss"
AGENT_RANK = -1  # the rank of a node's agent's own failure (no rank of it started)
TRACEBACK_LINES = 60  # the record keeps the innermost lines of a traceback


class NonFiniteLoss(RuntimeError):
    """The training loss was NaN or infinite at ``step`` (the run's N-th optimizer step, 1 for
    the first) of ``epoch`` (1 for the first), as every rank agreed."""

    def __init__(self, step: int, epoch: int) -> None:
        super().__init__(f"non-finite loss at step {step} (epoch {epoch})")
        self.step, self.epoch = step, epoch


class RepeatedFailure(RuntimeError, UserError):
    """The run's last failure ends it for good (see :func:`refusal`)."""


EXCEPTION_EXIT = 1  # a rank's uncaught exception (Python's exit status)


@dataclass(frozen=True)
class Failure:
    """One rank's failure."""

    rank: int
    host: str
    time: float  # Unix time the exception reached the rank's entry
    type: str  # the exception's class name
    message: str
    frame: str | None  # "path:line (in function)" of the innermost frame in the user's file
    step: int | None  # the training step it was in (1 for the first), where known
    epoch: int | None
    restart: int  # torchrun's restart count of the worker group
    traceback: str
    memory: dict[str, Any] | None = None  # out of memory: out_of_memory.figures
    signal: str | None = None  # the signal that killed the rank (SIGKILL), recorded for it

    @property
    def out_of_memory(self) -> bool:
        return self.memory is not None

    @property
    def named(self) -> bool:
        """Out of memory or killed: the cause, before any other rank's follow-on error."""
        return self.memory is not None or self.signal is not None

    @property
    def rendezvous(self) -> bool:
        """A node's agent failed its rendezvous (:func:`rendezvous_failed`): no code of the
        user's ran, the nodes did not meet."""
        return self.rank == AGENT_RANK and self.type.startswith("Rendezvous")

    def outcome(self) -> Outcome:
        """The slot's outcome for this failure (named by the failure alone: the launcher's
        exit status may be another rank's, below)."""
        if self.nonfinite:
            return outcomes.parse(self.message)  # non-finite loss at step 8 (epoch 1)
        if self.rendezvous:
            if self.type == "RendezvousTimeoutError":
                return Outcome(Kind.RENDEZVOUS_TIMEOUT)
            return Outcome(Kind.RENDEZVOUS_FAILED, self.type)
        if self.out_of_memory:
            return Outcome(Kind.OUT_OF_MEMORY)
        if self.signal is not None:
            return Outcome(Kind.KILLED, self.signal)
        # An uncaught exception ends its rank with Python's status 1, whatever the launcher's
        # says: srun's is its tasks' highest, and --kill-on-bad-exit may end another
        # node's agent with SIGTERM (143) as the failing one exits.
        return outcomes.crashed(EXCEPTION_EXIT)

    @property
    def nonfinite(self) -> bool:
        return self.type == NONFINITE

    @property
    def signature(self) -> tuple[Any, ...]:
        """What two failures share when they are the same crash."""
        return self.type, self.message, self.frame, self.step

    def cause(self) -> str:
        """One line naming the failure: ``rank 1 on cn08: RuntimeError: boom at
        tasks/x.py:31 (in forward), step 8 (epoch 1)``; a non-finite loss names its step."""
        if self.nonfinite:
            return self.message
        if self.rendezvous:
            return f"{self.host}: {self.message}"
        where = f" at {self.frame}" if self.frame else ""
        when = f", step {self.step} (epoch {self.epoch})" if self.step is not None else ""
        if self.memory is not None:
            what = out_of_memory.describe(self.memory)
            raised = "" if self.signal else f" ({self.type}{where}{when})"
            return f"out of memory on rank {self.rank} ({self.host}): {what}{raised}; " + (
                out_of_memory.HINT
            )
        if self.signal is not None:
            usual = f" (the OOM killer is the usual cause; {out_of_memory.HINT})"
            when = f" (last seen at step {self.step})" if self.step is not None else ""
            return (f"rank {self.rank} ({self.host}) killed by {self.signal}{when}"
                    + (usual if self.signal == "SIGKILL" else ""))  # fmt: skip
        return f"rank {self.rank} on {self.host}: {self.type}: {self.message}{where}{when}"


# -- on the ranks -------------------------------------------------------------------------

_step: tuple[int, int] | None = None
_recorded = False


def at_step(step: int, epoch: int) -> None:
    """(A rank) The step it trains now (1 for the run's first) and its epoch (1 for the first):
    named by a failure in it."""
    global _step
    _step = (step, epoch)


def _library_paths() -> tuple[str, ...]:
    import ddppipe

    paths = {sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    return (*sorted(paths), str(Path(ddppipe.__file__).parent))


def user_frame(tb: TracebackType | None, user_file: str | None) -> str | None:
    """The innermost frame of ``tb`` in ``user_file`` (``path:line (in function)``, the path
    relative to the working directory when below it); failing that, the innermost frame
    outside Python's and installed packages' files and ddppipe's; None if none is."""
    frames = traceback.extract_tb(tb)
    wanted = os.path.realpath(user_file) if user_file else None
    mine = [f for f in frames if wanted and os.path.realpath(f.filename) == wanted]
    if not mine:
        libraries = _library_paths()
        mine = [f for f in frames if not f.filename.startswith(libraries)
                and not f.filename.startswith("<")]  # fmt: skip
    if not mine:
        return None
    frame = mine[-1]
    path = Path(os.path.realpath(frame.filename))
    cwd = Path.cwd().resolve()
    shown = path.relative_to(cwd) if path.is_relative_to(cwd) else path
    return f"{shown}:{frame.lineno} (in {frame.name})"


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0][:500] if lines else ""


def record(error: BaseException) -> None:
    """(A rank) Record ``error`` as this rank's failure, once per process; a no-op for exits
    (SystemExit, KeyboardInterrupt) and a stop on a signal (no failure)."""
    global _recorded
    if _recorded or isinstance(error, SystemExit | KeyboardInterrupt | preemption.Preempted):
        return
    _recorded = True
    found = slot.read()
    now = time.time()
    lines = traceback.format_exception(type(error), error, error.__traceback__)
    text = "".join(lines).splitlines()[-TRACEBACK_LINES:]
    step, epoch = _step if _step is not None else (None, None)
    if isinstance(error, NonFiniteLoss):
        step, epoch = error.step, error.epoch
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    failure = Failure(
        rank=int(os.environ.get("RANK", "0")), host=socket.gethostname(), time=now,
        type=type(error).__name__, message=_first_line(error),
        frame=user_frame(error.__traceback__, found.user_file if found else None),
        step=step, epoch=epoch, restart=restart, traceback="\n".join(text),
        memory=out_of_memory.figures(error),
    )  # fmt: skip
    try:
        if found is not None:
            _write(StateDir(Path(found.state)).failures, failure)
        torch_file = os.environ.get(TORCH_ERROR_FILE_ENV)
        if torch_file and not os.path.exists(torch_file):
            atomic.write_json(torch_file, {"message": {
                "message": f"{failure.type}: {failure.message}",
                "extraInfo": {"py_callstack": failure.traceback, "timestamp": str(int(now))},
            }})  # fmt: skip
    except OSError as e:  # the rank's own error matters more than its record
        print(f"ddppipe: could not record this rank's failure ({e})", file=sys.stderr)


def _path(folder: Path, restart: int, rank: int, host: str) -> Path:
    """The record of ``rank`` in start ``restart`` (a node's agent's: one a node)."""
    node = f"-{host}" if rank == AGENT_RANK else ""
    return Path(folder) / f"restart{restart}-rank{rank}{node}.json"


def _write(folder: Path, failure: Failure) -> None:
    path = _path(folder, failure.restart, failure.rank, failure.host)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_json(path, asdict(failure))


# -- in the launcher ----------------------------------------------------------------------


def killed(folder: Path, rank: int, signum: int, restart: int, step: int | None = None,
           oom_killer: bool = False) -> Failure:  # fmt: skip
    """(The rank's watcher) Record rank ``rank``, killed by signal ``signum`` (the OOM
    killer's, with ``oom_killer``: its cgroup's counter rose) in start ``restart`` of the
    group, last seen at ``step`` (its heartbeat's) where known; an existing record of the
    rank is kept."""
    name = out_of_memory.signal_name(signum)
    failure = Failure(
        rank=rank, host=socket.gethostname(), time=time.time(), type=name,
        message=f"killed by {name}", frame=None, step=step, epoch=None, restart=restart,
        traceback="", memory=out_of_memory.killed_figures(oom_killer), signal=name,
    )  # fmt: skip
    if not _path(folder, restart, rank, failure.host).exists():
        with contextlib.suppress(OSError):
            _write(Path(folder), failure)
    return failure


def rendezvous_failed(folder: Path | None, error_type: str, endpoint: str,
                      timeout_s: int | None, restart: int) -> Failure:  # fmt: skip
    """(A node's agent) Record in ``folder`` (None: nowhere) that torchrun's rendezvous at
    ``endpoint`` failed with torch's ``error_type`` (``RendezvousTimeoutError`` after
    ``timeout_s``, its join timeout, or another ``RendezvousError``) in start ``restart``:
    what happened and what to check."""
    where = endpoint or "the step's first node"
    if error_type == "RendezvousTimeoutError":
        within = f" within {timeout_s} s (its join_timeout)" if timeout_s else ""
        what = (f"the step's nodes did not all join the rendezvous at {where}{within}: a node's "
                "agent did not start, or cannot reach it")  # fmt: skip
    else:
        what = f"the rendezvous at {where} failed ({error_type})"
    message = (
        f"{what}. Check the slot's log for another node's error before it, that every node "
        f"reaches {where} (a firewall between nodes, its name resolving to an address the "
        "others reach; slurm.rendezvous_host names another) and that all of the step's "
        "nodes started (sacct)"
    )
    host = socket.gethostname()
    failure = Failure(
        rank=AGENT_RANK, host=host, time=time.time(), type=error_type, message=message,
        frame=None, step=None, epoch=None, restart=restart, traceback="",
    )  # fmt: skip
    if folder is not None:
        with contextlib.suppress(OSError):
            _write(Path(folder), failure)
    return failure


def clear(state: StateDir) -> None:
    """Remove the records of an earlier slot from the folder this slot's ranks write to."""
    if state.failures.is_dir():
        for path in state.failures.glob("*.json"):
            path.unlink(missing_ok=True)


_NAME = re.compile(r"restart(\d+)-rank-?\d+(-.+)?\.json")


def last_restart(folder: Path) -> int:
    """The worker group's last start that left a record in ``folder`` (0: none), from the
    records' names: one listing of the folder, no record read (each node's agent asks: a read
    of every rank's record by every agent is nodes x ranks reads)."""
    try:
        names = os.listdir(folder)
    except OSError:  # (no folder yet: no record)
        return 0
    starts = (int(m[1]) for m in map(_NAME.fullmatch, names) if m)
    return max(starts, default=0)


def read_all(folder: Path) -> list[Failure]:
    """Every record in ``folder`` (unreadable ones skipped), oldest first."""
    found = []
    for path in Path(folder).glob("restart*-rank*.json"):
        try:
            found.append(Failure(**json.loads(path.read_text())))
        except (OSError, ValueError, TypeError):
            continue
    return sorted(found, key=lambda f: f.time)


def first(folder: Path) -> Failure | None:
    """The first failure of the worker group's last start (the others follow from it)."""
    found = read_all(folder)
    if not found:
        return None
    last = max(f.restart for f in found)
    return _cause([f for f in found if f.restart == last])


def _cause(found: list[Failure]) -> Failure | None:
    """The first of ``found`` (oldest first) out of memory or killed, else the first."""
    return next((f for f in found if f.named), found[0] if found else None)


def first_of_restart(folder: Path, restart: int) -> Failure | None:
    """The first failure of the worker group's start number ``restart`` (0: the first)."""
    return _cause([f for f in read_all(folder) if f.restart == restart])


def identity(spec: RunSpec) -> str:
    """What a final failure belongs to: the SHA-256 of the run's resolved config (which holds
    the task file's or script's SHA-256)."""
    config = json.dumps(spec.as_dict(), sort_keys=True, default=str)
    return hashlib.sha256(config.encode()).hexdigest()


def finalize(state: StateDir, failure: Failure, config_id: str, why: str) -> None:
    """Record ``failure`` as the end of the run for config ``config_id`` (``why``: in words)."""
    atomic.write_json(
        state.final_failure,
        {"config": config_id, "why": why, "failure": asdict(failure)},
    )


def refusal(state: StateDir, config_id: str) -> str | None:
    """Why a slot of config ``config_id`` must not train (its final failure), or None; a
    final failure of another config is removed."""
    path = state.final_failure
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if found.get("config") != config_id:
        path.unlink(missing_ok=True)
        return None
    failure = Failure(**found["failure"])
    return (
        f"not training: {found['why']}: {failure.cause()}. Fix the task file, script or "
        f"config (a change lifts this), or delete {path} to try the same again"
    )
