"""One slot of a training run, start to end: attempt record, training, what next.

The slot's processes check their nodes and their world before step 1 (the slot record's
``checks`` in a SLURM job of its own: :mod:`ddppipe.parallel.node_check`,
:mod:`ddppipe.training.measuring.world_checks`); a node whose own check failed is named on the
srun step's stderr, and excluded from the next slot here (:func:`_end`, the slot
machine's order of end causes).

In a SLURM job the launcher times the warning itself: SIGUSR1 to the training
``slurm.signal_seconds`` before the job's end (SLURM's own ``--signal`` may come up to a
minute early, its resolution, and would reach every process of a step).

``ddppipe launch`` (the train rule) calls :func:`run`. Its exit status: 0 when training is
complete; :data:`~ddppipe.runstate.preemption.EXIT_CODE` (75) when it stopped on a signal after a
checkpoint and goes on (in SLURM: the job has requeued itself, or SLURM requeues it; outside:
run it again), also when srun exited 0 though a node's ranks did not finish (srun does on a
node failure); the training's own status when it crashed; 1 when a SLURM run stopped making
progress or reached ``slurm.max_continuations``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar

from ddppipe.core import atomic, env_names, process_times, slot
from ddppipe.launching import launch, preflight, slot_machine, watchdog
from ddppipe.runstate import attempts, failures, origin, outcomes, preemption, state_lock
from ddppipe.runstate.outcomes import Kind, Outcome
from ddppipe.runstate.state import StateDir
from ddppipe.settings.run_spec import RunSpec
from ddppipe.slurm import bad_nodes, memory_request, scontrol
from ddppipe.slurm import request as slurm_request

log = logging.getLogger(__name__)


@contextlib.contextmanager
def slot_log(state: StateDir, copy: Path) -> Iterator[None]:
    """Append this process's stderr (and its children's) to the state's train.log, which
    survives every slot, and copy it to ``copy`` (the rule's log) when the slot ends.

    Snakemake deletes a job's log when the job (a slot) starts, so the log of a run trained
    in several slots lives in the state folder.
    """
    state.root.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    saved = os.dup(2)
    with open(state.log, "ab") as sink:
        os.dup2(sink.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        Path(copy).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(state.log, copy)


def mark_slot_end(state: StateDir) -> None:
    """Record that this slot's launcher ends (any outcome): the submitting Snakemake checks
    SLURM at once (ddppipe.slurm.executor.status_checks). Best effort: without it, the plugin's next
    check."""
    marker = state.slot_ended
    with contextlib.suppress(OSError):  # never hides the slot's own outcome or error
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()


def run(
    spec: RunSpec, python: list[str], program: list[str], state: StateDir, record: Path | None,
    publish: Callable[[], None] | None = None, data: Path | None = None,
) -> int:  # fmt: skip
    """Train one slot of ``program`` (``-m ddppipe train ...`` or a script and its arguments),
    started by ``python`` (the run's: :func:`~ddppipe.apptainer.running.python_command`).

    ``record`` receives the attempt history and ``publish`` runs when training is complete;
    ``data``: the task's data folder (where its slots' data comes from).

    In a job that survives a node failure (``slurm.spare_nodes``, ``slurm.min_nodes``) a
    node lost mid-step ends the slot as "node failure", and a node that fails its own checks
    as "bad node"; the next slot starts at once in the same job, on the nodes left
    (:func:`_continue_after_loss`).
    """
    lost: list[str] = []
    plan = launch.plan(spec, [], python, program=program, exclude=_bad(state))
    with state_lock.hold(state, plan.job):
        while True:
            outcome = _slot(spec, plan, state, record, publish, data, continued=bool(lost))
            if not isinstance(outcome, NodeLoss):
                return outcome
            lost += outcome.nodes
            next_plan = _continue_after_loss(spec, plan, state, python, program, lost)
            if next_plan is None:
                return _carry_out([outcome.otherwise], preemption.EXIT_CODE, spec, state)
            plan = next_plan


@dataclass(frozen=True)
class NodeLoss:
    """A slot ended by the loss of ``nodes`` (its job goes on without them; ``otherwise``:
    what to do when it cannot)."""

    nodes: list[str]
    otherwise: slot_machine.Requeue | slot_machine.Refuse


def _bad(state: StateDir, lost: list[str] | None = None) -> list[str]:
    """The nodes no step of the run may use: its bad-node record's and those ``lost``."""
    return [*bad_nodes.of_run(state).load(), *(lost or [])]


def _continue_after_loss(
    spec: RunSpec, plan: launch.Plan, state: StateDir, python: list[str], program: list[str],
    lost: list[str],
) -> launch.Plan | None:  # fmt: skip
    """The plan of the next step in the same job without the ``lost`` nodes: a spare in their
    place, else the nodes left down to slurm.min_nodes. None when too few are left."""
    after = _ask(lambda: launch.plan(spec, [], python, program=program,
                                     hosts=scontrol.job_nodes(str(plan.job)),
                                     exclude=_bad(state, lost)),
                 None, logging.ERROR,
                 f"cannot go on in job {plan.job} without {', '.join(lost)} ({{}})")  # fmt: skip
    if after is None:
        return None
    spares = [h for h in after.hosts if h not in plan.hosts]
    log.warning(
        "going on in job %s on %s (%s), from the newest checkpoint", plan.job,
        ",".join(after.hosts),
        f"spare {', '.join(spares)} in place of {', '.join(lost)}" if spares else
        f"{len(after.hosts)} of {spec.launch.nnodes} nodes, world size {after.request.world_size}",
    )  # fmt: skip
    return after


def slot_record(spec: RunSpec, state: StateDir, opened: attempts.Attempt,
                warn_in: float | None, end: float | None,
                checks: bool = False) -> slot.Slot:  # fmt: skip
    """The record of this slot (``opened``: its attempt) for every process of it; ``checks``:
    its ranks check their nodes and world before step 1."""
    tensorboard = state.tensorboard.resolve() if spec.tracking.tensorboard else None
    return slot.Slot(
        run=spec.run, state=str(state.root.resolve()), attempt=opened.number,
        start=opened.start, end=end, stop_at=None if warn_in is None else time.time() + warn_in,
        stop_signal=spec.slurm.stop_signal, device=spec.device, strategy=spec.launch.strategy,
        activation_checkpointing=spec.train.activation_checkpointing,
        tensorboard=str(tensorboard) if tensorboard else None, mlflow=spec.tracking.mlflow or None,
        user_file=(spec.task_source or {}).get("path") or None, nccl_trace=spec.gpus,
        checks=checks,
    )  # fmt: skip


def _slot(
    spec: RunSpec, plan: launch.Plan, state: StateDir, record: Path | None,
    publish: Callable[[], None] | None, data: Path | None = None, continued: bool = False,
) -> int | NodeLoss:  # fmt: skip
    """One slot; ``continued``: it goes on in the job of the slot before, which lost a node
    (:func:`run`): it starts now, not at the launcher's or the job's start, and did not queue
    (the job's wait is its first slot's)."""
    restarts, warn_in, end, queue_s, submitted = 0, None, None, 0.0, None
    mem_mb, job_start = None, None  # what a node of the job asked for, its start (SLURM)
    launcher_start = time.time() if continued else process_times.started() or time.time()
    marks = {"launcher_process": launcher_start}  # (ddppipe.runstate.startup)
    refused = failures.refusal(state, failures.identity(spec))
    if refused:  # a retry of a run that failed for good: in seconds, before it starts
        raise failures.RepeatedFailure(refused)
    if plan.own_job:
        job = _job_record(plan.job)
        restarts = int(job.get("Restarts", "0") or 0)
        queue_s = 0.0 if continued else scontrol.queue_seconds(job)  # (its first slot's)
        submitted = scontrol.submitted(job)
        mem_mb, job_start = memory_request.requested_mb(job), scontrol.started(job)
        left = scontrol.seconds_left(job)
        if left is not None:  # None: no time limit
            end = time.time() + left
            warn_in = max(0.0, left - plan.request.signal_seconds)
            log.info("time-limit warning in %.0fs (%.0fs before the job's end)",
                     warn_in, plan.request.signal_seconds)  # fmt: skip
    packed = os.environ.get(env_names.PACKED_SLOT)  # a packed trial: its allocation's slot
    if packed and end is None:  # warned before its allocation's end, by its own timer
        warn_in, end = preemption.allocation_warning()
    history = attempts.begin(state, plan.job, restarts, plan.hosts, queue_s, submitted, packed,
                             _lost_as(state, plan.job, restarts), mem_mb,
                             origin.taken(data), marks, job_start)  # fmt: skip
    _check_origin(state, history)
    log.info("attempt %d of this run; run: %s", len(history), " ".join(plan.command))
    failures.clear(state)
    opened = slot_record(spec, state, history[-1], warn_in, end, checks=plan.own_job)
    watch = watchdog.Watchdog(spec, state, len(history), plan.job, plan.request.world_size)
    attempts.mark(state, "launcher_ranks_launched")
    ended = launch.supervise(plan, plan.env, opened, warn_in, watch)
    unwatched = "" if watch.watched else watchdog.NO_WATCHDOG_NOTE
    if unwatched:
        log.warning("%s", unwatched)
    return _end(spec, plan.slot_state(), state, ended, record, publish, unwatched)


def _end(
    spec: RunSpec, slot: slot_machine.SlotState, state: StateDir, ended: launch.Ended,
    record: Path | None = None, publish: Callable[[], None] | None = None, unwatched: str = "",
) -> int | NodeLoss:  # fmt: skip
    """How the slot ended (:func:`slot_machine.step`, from what its step and, where the end
    depends on it, SLURM said: asked here, once each), carried out."""
    asks = slot_machine.asks_slurm(slot, ended.code, ended.note, ended.checks)
    job = str(slot.job)
    facts = slot_machine.Facts(
        tuple(attempts.closing(state)), failures.first(state.failures),
        _ask(lambda: scontrol.job_record(job), {}, logging.WARNING,
             f"scontrol show job {job} failed ({{}})") if asks else None,
        _ask(lambda: scontrol.node_states(list(slot.hosts)), {}, logging.WARNING,
             "scontrol show node failed ({})") if asks else {},
        tuple(_bad(state)), unwatched, time.time(),
    )  # fmt: skip
    exited = slot_machine.Exited(ended.code, ended.note, facts, tuple(ended.checks))
    slot, actions = slot_machine.step(slot, exited)
    assert slot.exit_status is not None
    return _carry_out(actions, slot.exit_status, spec, state, record, publish)


def _carry_out(
    actions: list[slot_machine.Action], exit_status: int, spec: RunSpec, state: StateDir,
    record: Path | None = None, publish: Callable[[], None] | None = None,
) -> int | NodeLoss:  # fmt: skip
    """Carry out the ``actions`` of a slot's end; the launcher's exit status (or the loss of
    nodes its job goes on without)."""
    for action in actions:
        if isinstance(action, slot_machine.Say):
            log.log(action.level, "%s", action.text)
        elif isinstance(action, slot_machine.RecordBadNodes):
            bad_nodes.of_run(state).save(list(action.nodes))
        elif isinstance(action, slot_machine.Publish) and publish is not None:
            publish()
        elif isinstance(action, slot_machine.Finish):
            history = attempts.finish(state, action.outcome, action.exit_status, action.detail,
                                      action.failure)  # fmt: skip
            if action.said:
                log.log(action.level, "%s; attempts:\n%s", action.said, attempts.table(history))
            if action.copy and record is not None:
                atomic.write_json(record, [asdict(a) for a in history])
        elif isinstance(action, slot_machine.Finalize):
            failures.finalize(state, action.failure, failures.identity(spec), action.why)
        elif isinstance(action, slot_machine.Requeue):
            requeued = _ask(lambda job=action.job: scontrol.requeue(job) or True, False,
                            logging.ERROR, f"could not requeue job {action.job} ({{}}); exiting "
                            f"{preemption.EXIT_CODE}: Snakemake retries the job, which uses one "
                            "of its --retries")  # fmt: skip
            if requeued:
                log.warning("requeued job %s: its next slot resumes from %s", action.job,
                            action.resumes_from)  # fmt: skip
        elif isinstance(action, slot_machine.Refuse):
            raise preflight.PreflightError(action.message, list(action.nodes))
        elif isinstance(action, slot_machine.GoOn):
            return NodeLoss(list(action.nodes), action.otherwise)
    return exit_status


SLURM_ERRORS = (OSError, subprocess.SubprocessError, slurm_request.SlurmRequestError)
T = TypeVar("T")


def _ask(call: Callable[[], T], otherwise: T, level: int, said: str) -> T:
    """``call`` (a SLURM command) or, when it fails, ``otherwise``, and ``said`` in the log
    with the error in its ``{}``: the launcher's one try/except around SLURM."""
    try:
        return call()
    except SLURM_ERRORS as e:
        log.log(level, "%s", said.format(str(getattr(e, "stderr", "") or e).strip()))
        return otherwise


def _check_origin(state: StateDir, history: list[attempts.Attempt]) -> None:
    """A slot whose code or data is not what the run's training started from: each change
    named in the log and in its attempt record (the provenance keeps the start's)."""
    began = origin.started([asdict(a) for a in history[:-1]])
    now = history[-1].origin
    if began is None or now is None:
        return
    found = origin.changes(began[1], now, began[0])
    for change in found:
        log.warning("%s", change)
    if found:
        history[-1].detail = "; ".join(found)
        attempts.save(state, history)


def _lost_as(state: StateDir, job: str | None, restarts: int) -> Outcome:
    """The outcome of the last slot left open (its launcher killed: on a failed node it dies
    with the node), as SLURM tells it now (:func:`slot_machine.lost`); else LOST."""
    left_open = [a for a in attempts.load(state) if a.kind is Kind.RUNNING]
    if job is None or not left_open:
        return outcomes.lost()
    last = left_open[-1]
    nodes = _ask(lambda: scontrol.node_states(last.nodes), {}, logging.WARNING,
                 f"scontrol show node {','.join(last.nodes)} failed ({{}})")  # fmt: skip
    requeued = last.job == job and restarts > last.restarts
    return slot_machine.lost(nodes, requeued) or outcomes.lost()


def _job_record(job: str) -> dict[str, str]:
    return _ask(lambda: scontrol.job_record(job), {}, logging.WARNING,
                f"scontrol show job {job} failed ({{}})")  # fmt: skip
