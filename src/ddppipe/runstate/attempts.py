"""The attempt history of a run: one record per job slot (or local launch) that trained it.

The launcher opens a record when it starts and closes it when training ends; rank 0 leaves
its progress (the checkpoint it resumed from, the checkpoints it wrote and how long they
took) in ``progress.json``, which the record takes over. Both files live in the run's state
folder, which survives failed and requeued jobs.
"""

from __future__ import annotations

import html
import json
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from ddppipe.core import atomic
from ddppipe.runstate import outcomes, startup
from ddppipe.runstate.outcomes import Kind, Outcome
from ddppipe.runstate.state import StateDir

LOST = outcomes.lost().label  # a slot's whose launcher was killed before it could say


@dataclass
class Attempt:
    """One job slot's share of a run."""

    number: int
    job: str  # SLURM job id, or "local"
    restarts: int  # SLURM's requeue count of the job when this slot started
    nodes: list[str]
    start: float  # Unix time the slot started: its job's start, else its launcher's (startup)
    end: float | None = None
    outcome: str = Kind.RUNNING.value  # its label (ddppipe.runstate.outcomes): completed, ...
    exit_status: int | None = None
    resumed_from: str | None = None  # checkpoint file name, None for a fresh start
    start_step: int | None = None  # global optimizer step it started at
    end_step: int | None = None  # global step of the last checkpoint it wrote
    checkpoint: str | None = None  # the last checkpoint it wrote
    checkpoint_seconds: float | None = None  # slowest checkpoint write of the slot
    stop_seconds: float | None = None  # from the stop signal to its checkpoint written
    # rank 0's figures (ddppipe.training.measuring.efficiency)
    efficiency: dict[str, Any] | None = None
    queue_s: float | None = None  # SLURM: waiting from (re)submission to start; 0 locally
    # its nodes' GEMM peaks, measured by its ranks' checks (ddppipe.training.measuring.
    # world_checks: a SLURM job of its own), if they ran
    peak: dict[str, Any] | None = None
    submitted: float | None = None  # SLURM: Unix time of the job's submission (or requeue)
    detail: str = ""  # the cause in words: a failure's (ddppipe.runstate.failures), a reason
    failure: dict[str, Any] | None = None  # the first failing rank's record, when one failed
    slot: str | None = None  # a packed sweep's trial: its allocation's slot, "<node>/<k>"
    world_size: int | None = None  # the ranks it trained with (a run may resume at another)
    # micro-steps a step (ddppipe.data.sharding.micro_steps): above 1 in a world smaller than
    # the run's (slurm.min_nodes), each rank's batch kept, its gradients accumulated
    micro_steps: int | None = None
    strategy: str | None = None  # ddp | fsdp (launch.strategy)
    # what its ranks trained in: train.precision as configured, as decided where the ranks
    # started (auto: bf16 only if every rank's device computes it natively), the hosts that
    # only emulate bf16 (ddppipe.parallel.precision)
    precision: dict[str, Any] | None = None
    # whether its steps ran as a CUDA graph (train.cuda_graphs), and why: configured, capture,
    # reason (ddppipe.training.loop.graphs); a fall-back during the slot replaces it
    cuda_graphs: dict[str, Any] | None = None
    mem_mb: int | None = None  # SLURM: the memory a node of its job asked for (--mem)
    # what it started from: git commit and dirty state, the data's manifest digest
    # (ddppipe.runstate.origin; the provenance takes the one of the slot training started in)
    origin: dict[str, Any] | None = None
    # its start-up: the clock readings its processes left (ddppipe.core.process_times), and
    # the parts derived from them once it ended (ddppipe.runstate.startup; name: seconds)
    marks: dict[str, float] | None = None
    startup: dict[str, float] | None = None

    @property
    def kind(self) -> Kind:
        """How it ended (:class:`~ddppipe.runstate.outcomes.Kind`; RUNNING while open)."""
        return outcomes.parse(self.outcome).kind

    @property
    def steps(self) -> int:
        """Optimizer steps this slot trained and checkpointed."""
        if self.end_step is None or self.start_step is None:
            return 0
        return self.end_step - self.start_step


def read(path: Path) -> list[Attempt]:
    """The history in ``path`` (a state folder's or the train rule's copy); [] if none."""
    if not Path(path).exists():
        return []
    known = {f.name for f in fields(Attempt)}
    records = json.loads(Path(path).read_text())
    return [Attempt(**{k: v for k, v in r.items() if k in known}) for r in records]


def load(state: StateDir) -> list[Attempt]:
    return read(state.attempts)


def save(state: StateDir, history: list[Attempt]) -> None:
    atomic.write_json(state.attempts, [asdict(a) for a in history])


def begin(
    state: StateDir, job: str | None, restarts: int, nodes: list[str], queue_s: float = 0.0,
    submitted: float | None = None,
    packed: str | None = None,
    lost: Outcome | None = None,
    mem_mb: int | None = None,
    origin: dict[str, Any] | None = None,
    marks: dict[str, float] | None = None,
    job_start: float | None = None,
) -> list[Attempt]:  # fmt: skip
    """Open this slot's record; a record left open by a killed launcher is closed as ``lost``
    (what SLURM says of it, where it can: ddppipe.launching.lifecycle; else LOST). ``mem_mb``:
    what a node of the slot's job asked for (SLURM), which its measured peak is judged against;
    ``origin``: what it starts from (:mod:`ddppipe.runstate.origin`); ``marks``: the
    launcher's start-up marks so far (:mod:`ddppipe.runstate.startup`); ``job_start``: its own
    SLURM job's start, the slot's start unless an earlier slot of the run had the same job.

    ``packed``: a packed trial's ``"<allocation> <node>/<k>"``
    (:data:`ddppipe.core.env_names.PACKED_SLOT`)."""
    history = load(state)
    for attempt in history:
        if attempt.kind is Kind.RUNNING:
            attempt.outcome = (lost or outcomes.lost()).label
    state.progress.unlink(missing_ok=True)
    number = len(history) + 1
    allocation, _, slot = (packed or "").partition(" ")
    name = job or allocation or "local"
    marks = dict(marks or {})
    if history and (history[-1].job, history[-1].restarts) == (name, restarts):
        job_start = None  # a later slot of the same job: from its own launcher's start
    start = startup.slot_start(time.time(), marks.get(startup.LAUNCHER_PROCESS), job_start)
    if job_start is None:  # the slot started with its launcher
        marks.pop(startup.LAUNCHER_PROCESS, None)
    history.append(Attempt(number, name, restarts, nodes, start, queue_s=queue_s,
                           submitted=submitted, slot=slot or None, mem_mb=mem_mb,
                           origin=origin, marks=marks or None))  # fmt: skip
    save(state, history)
    return history


def mark(state: StateDir, key: str) -> None:
    """Note the start-up mark ``key`` (:mod:`ddppipe.runstate.startup`) now in the open record."""
    history = load(state)
    history[-1].marks = {**(history[-1].marks or {}), key: time.time()}
    save(state, history)


def read_progress(state: StateDir) -> dict[str, Any]:
    """Rank 0's progress of the current slot ({} before it has resumed)."""
    try:
        return json.loads(state.progress.read_text())
    except (FileNotFoundError, ValueError):
        return {}


def write_progress(state: StateDir, progress: dict[str, Any]) -> None:
    """(Rank 0) The slot's progress so far; see :class:`Attempt` for the keys."""
    atomic.write_json(state.progress, progress)


def finish(
    state: StateDir, outcome: Outcome | str, exit_status: int, detail: str = "",
    failure: dict[str, Any] | None = None,
) -> list[Attempt]:  # fmt: skip
    """Close the open record with how the slot ended (``outcome``: a label is checked,
    :func:`ddppipe.runstate.outcomes.parse`; ``failure``: the first failing rank's
    record) and rank 0's progress; ``detail`` follows what the record says already (a changed
    origin)."""
    history = closing(state)
    attempt = history[-1]
    label = outcome.label if isinstance(outcome, Outcome) else outcomes.parse(outcome).label
    attempt.end, attempt.outcome, attempt.exit_status = time.time(), label, exit_status
    attempt.detail = "; ".join(filter(None, [attempt.detail, detail]))
    attempt.failure = failure
    _start_up(attempt)
    save(state, history)
    return history


PROGRESS = ("resumed_from", "start_step", "end_step", "checkpoint", "checkpoint_seconds",
            "stop_seconds", "efficiency", "world_size", "micro_steps", "strategy",
            "precision", "peak", "cuda_graphs")  # fmt: skip


def closing(state: StateDir) -> list[Attempt]:
    """The history with rank 0's progress in the open record (the last), as it closes."""
    history = load(state)
    progress = read_progress(state)
    for key in PROGRESS:
        if key in progress:
            setattr(history[-1], key, progress[key])
    return history


def _start_up(attempt: Attempt) -> None:
    """The slot's start-up in parts, from its launcher's marks and its ranks' (their figures'
    ``startup_marks``); its figures' ``startup_s`` the parts' (:mod:`ddppipe.runstate.startup`)."""
    figures = attempt.efficiency
    if not figures or not figures.get("startup_marks"):
        return
    attempt.marks = {**(attempt.marks or {}), **figures.pop("startup_marks")}
    attempt.startup = startup.parts(attempt.start, attempt.marks)
    if startup.FIRST_STEP in attempt.startup:
        figures["startup_s"] = startup.before_first_step(attempt.startup)


def measured_checkpoint_seconds(state: StateDir) -> float | None:
    """The longest checkpoint write (or signal-to-checkpoint stop) the run measured, if any."""
    progress = read_progress(state)
    times = [
        *(t for a in load(state) for t in (a.checkpoint_seconds, a.stop_seconds)),
        progress.get("checkpoint_seconds"), progress.get("stop_seconds"),
    ]  # fmt: skip
    return max((t for t in times if t), default=None)


COLUMNS = ("#", "job", "nodes", "queued s", "start", "end", "outcome", "resumed from", "steps",
           "start-up s", "training s", "images/s")  # fmt: skip


def _figure(figures: dict[str, Any], key: str, spec: str) -> str:
    return format(figures[key], spec) if key in figures else "-"


def columns(shares: dict[int, float] | None = None) -> tuple[str, ...]:
    """The table's columns; with ``shares``, each slot's goodput last."""
    return COLUMNS + (("goodput",) if shares is not None else ())


def rows(history: list[Attempt], shares: dict[int, float] | None = None) -> list[tuple[str, ...]]:
    """One row per slot; ``shares``: each slot's goodput by its number (ddppipe.reports.goodput,
    above this package), a column of its own ("-" for a slot without one)."""

    def when(t: float | None) -> str:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"

    out = []
    for a in history:
        job = a.job if not a.restarts else f"{a.job} (requeue {a.restarts})"
        figures = a.efficiency or {}
        out.append((
            str(a.number), job, ",".join(a.nodes), "-" if a.queue_s is None else f"{a.queue_s:.0f}",
            when(a.start), when(a.end), a.outcome,
            a.resumed_from or "(start)", str(a.steps), _figure(figures, "startup_s", ".1f"),
            _figure(figures, "train_s", ".1f"), _figure(figures, "images_per_s", ",.0f"),
        ))  # fmt: skip
        if shares is not None:
            out[-1] += (f"{shares[a.number]:.0%}" if a.number in shares else "-",)
    return out


def table(history: list[Attempt], shares: dict[int, float] | None = None) -> str:
    """The history as a plain-text table (the launcher's log, ``ddppipe attempts``: with each
    slot's goodput, ``shares``)."""
    lines = [columns(shares), *rows(history, shares)]
    widths = [max(len(row[i]) for row in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                     for row in lines)  # fmt: skip


def html_table(history: list[Attempt], run: str, shares: dict[int, float] | None = None) -> str:
    """A small HTML page of the history (the report's "Training" section); ``shares``: as for
    :func:`table`."""
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns(shares))
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
        for row in rows(history, shares)
    )
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(run)}: attempts"
        f"</title></head><body><h1>{html.escape(run)}: {len(history)} attempt(s)</h1>"
        f"<table border='1' cellpadding='4'><tr>{head}</tr>{body}</table></body></html>\n"
    )
