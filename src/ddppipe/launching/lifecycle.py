"""One slot of a training run, start to end: attempt record, training, what next.

The slot's processes check their nodes and their world before step 1 (the slot record's
``checks`` in a SLURM job of its own: :mod:`ddppipe.parallel.node_check`,
:mod:`ddppipe.training.measuring.world_checks`); a node whose own check failed is named on the
srun step's stderr, and excluded from the next slot here (:func:`_failed_checks`).

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
from typing import Any, NoReturn

from ddppipe.core import atomic, env_names, process_times, slot
from ddppipe.launching import launch, preflight, watchdog
from ddppipe.parallel import node_check
from ddppipe.runstate import attempts, failures, origin, outcomes, preemption, state_lock
from ddppipe.runstate.outcomes import Kind, Outcome
from ddppipe.runstate.state import StateDir
from ddppipe.settings.run_spec import RunSpec
from ddppipe.slurm import bad_nodes, continuation, memory_request, scontrol
from ddppipe.slurm import request as slurm_request

log = logging.getLogger(__name__)
NO_PROGRESS_EXIT = 1
HUNG_EXIT = 1  # a local slot that hung (ddppipe.launching.watchdog)


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
    spec: RunSpec, program: list[str], state: StateDir, record: Path | None,
    publish: Callable[[], None] | None = None, data: Path | None = None,
) -> int:  # fmt: skip
    """Train one slot of ``program`` (``-m ddppipe train ...`` or a script and its arguments).

    ``record`` receives the attempt history and ``publish`` runs when training is complete;
    ``data``: the task's data folder (a packed one's image bound into the container).

    In a job that survives a node failure (``slurm.spare_nodes``, ``slurm.min_nodes``) a
    node lost mid-step ends the slot as "node failure" and the next slot starts at once in
    the same job, on the nodes left (:func:`_continue_after_loss`).
    """
    lost: list[str] = []
    plan = launch.plan(spec, [], program=program, data=data, exclude=_bad(state))
    with state_lock.hold(state, plan.job):
        while True:
            outcome = _slot(spec, plan, state, record, publish, data, continued=bool(lost))
            if not isinstance(outcome, NodeLoss):
                return outcome
            lost += outcome.nodes
            next_plan = _continue_after_loss(spec, plan, state, program, data, lost)
            if next_plan is None:
                return preemption.EXIT_CODE
            plan = next_plan


@dataclass(frozen=True)
class NodeLoss:
    """A slot ended by the loss of ``nodes`` (its job goes on without them)."""

    nodes: list[str]


def _bad(state: StateDir, lost: list[str] | None = None) -> list[str]:
    """The nodes no step of the run may use: its bad-node record's and those ``lost``."""
    return [*bad_nodes.of_run(state).load(), *(lost or [])]


def _continue_after_loss(
    spec: RunSpec, plan: launch.Plan, state: StateDir, program: list[str], data: Path | None,
    lost: list[str],
) -> launch.Plan | None:  # fmt: skip
    """The plan of the next step in the same job without the ``lost`` nodes: a spare in their
    place, else the nodes left down to slurm.min_nodes. None when too few are left: the job
    requeues itself (its next slot gets healthy nodes)."""
    try:
        nodes = scontrol.job_nodes(str(plan.job))
        after = launch.plan(spec, [], program=program, data=data, hosts=nodes,
                            exclude=_bad(state, lost))  # fmt: skip
    except (slurm_request.SlurmRequestError, OSError, subprocess.SubprocessError) as e:
        log.error("cannot go on in job %s without %s (%s): requeueing it", plan.job,
                  ", ".join(lost), e)  # fmt: skip
        _requeue(str(plan.job))
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
        queue_s = 0.0 if continued else continuation.queue_seconds(job)  # (its first slot's)
        submitted = continuation.submitted(job)
        mem_mb, job_start = memory_request.requested_mb(job), continuation.started(job)
        left = continuation.seconds_left(job)
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
    code, note = ended.code, ended.note
    if code != 0 and plan.own_job and ended.checks:
        _failed_checks(spec, plan, state, ended.checks, code)
    unwatched = "" if watch.watched else watchdog.NO_WATCHDOG_NOTE
    if unwatched:
        log.warning("%s", unwatched)
    if note is not None and note.get("lost"):
        return _node_lost(spec, plan, state, note)
    if note is not None and note.get("unfinished") and not _ending(plan):
        log.warning(
            "no finished mark from %s, but SLURM runs the job on working nodes: srun's exit 0 "
            "stands (the state folder's filesystem shows other nodes' files late?)",
            ", ".join(note["unfinished"]),
        )  # fmt: skip
        note = None
    if note is not None:
        return _stopped(plan, note, state)
    if code == 0:
        if publish is not None:
            publish()
        history = attempts.finish(state, Outcome(Kind.COMPLETED), 0, unwatched)
        log.info("training complete; attempts:\n%s", attempts.table(history))
        if record is not None:
            atomic.write_json(record, [asdict(a) for a in history])
        return 0
    failed = _failed_nodes(plan)
    if failed:  # SLURM ended the step for a node's failure: no crash of the user's code
        return _stopped(plan, {"signal": None, "checkpoint": None, "unfinished": failed}, state)
    return _failed(spec, state, code)


def _failed_nodes(plan: launch.Plan) -> list[str]:
    """The nodes of a SLURM slot's step that SLURM sees failed (down, not responding) as the
    step ends; none locally or when scontrol cannot say."""
    if plan.job is None:
        return []
    try:
        return continuation.failed_nodes(scontrol.node_states(plan.hosts))
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("scontrol show node failed (%s)", e)
        return []


def _node_lost(spec: RunSpec, plan: launch.Plan, state: StateDir, note: dict[str, Any]) -> NodeLoss:
    """The slot's step lost ``note["lost"]``: the nodes recorded as bad (the run's later
    submissions exclude them), the slot closed as "node failure"."""
    lost = note["lost"]
    decision = bad_nodes.of_run(state).add(lost, plan.hosts, spec.slurm.max_excluded_nodes,
                                           bad_nodes.NEXT_STEPS, bad_nodes.LOST)  # fmt: skip
    history = attempts.finish(state, Outcome(Kind.NODE_FAILURE), preemption.EXIT_CODE,
                              f"{note.get('detail')}; {decision.reason}")  # fmt: skip
    log.error("lost %s; attempts:\n%s", ", ".join(lost), attempts.table(history))
    return NodeLoss(lost)


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


def _failed(spec: RunSpec, state: StateDir, code: int) -> int:
    """Training failed: its first failure (ddppipe.runstate.failures) named in the attempt
    record and the log. A non-finite loss, or the same failure as the slot before, ends the run
    for good: a retry of the same config refuses to train."""
    failure = failures.first(state.failures)
    if failure is None:  # no rank recorded an exception: killed (SIGKILL, out of memory)
        attempts.finish(state, outcomes.crashed(code), code)
        return code
    outcome = failure.outcome(code)  # out of memory, killed by a signal, crashed
    history = attempts.finish(state, outcome, code, failure.cause(), asdict(failure))
    if failure.nonfinite:
        log.error("training failed: %s", failure.cause())
        final: str | None = "the loss was not finite"
    else:
        shown = (f"\nthe first failure's traceback (rank {failure.rank} on {failure.host}):\n"
                 f"{failure.traceback}" if failure.traceback else "")  # fmt: skip
        log.error("training failed: %s%s", failure.cause(), shown)  # a killed rank: no traceback
        before = history[-2].failure if len(history) > 1 else None
        same = before is not None and failures.Failure(**before).signature == failure.signature
        same = same and not (failure.signal and failure.step is None)  # a kill at no known step
        same = same and not failure.rendezvous  # the nodes', not the code's: other nodes may meet
        final = f"slots {len(history) - 1} and {len(history)} failed the same way" if same else None
    if final is not None:
        failures.finalize(state, failure, failures.identity(spec), final)
        if not failure.nonfinite:  # the outcome of a non-finite loss says it all
            history[-1].detail += f" ({final}: not retried)"
            attempts.save(state, history)
        log.error("not retrying: %s", final)
    return code


def _failed_checks(
    spec: RunSpec, plan: launch.Plan, state: StateDir, lines: list[str], code: int
) -> NoReturn:
    """Nodes of the slot failed their own checks (``lines``: what they said): record them in
    the run's bad-node record for the next slot's submission (ddppipe.slurm.bad_nodes) where
    they are some of the slot's nodes, close the attempt, and raise PreflightError."""
    nodes = node_check.failing_nodes("\n".join(lines), plan.hosts)
    decision = bad_nodes.of_run(state).add(nodes, plan.hosts, spec.slurm.max_excluded_nodes)
    said = "\n  ".join(dict.fromkeys(line.removeprefix(node_check.PREFIX) for line in lines))
    if decision.excluded:
        outcome = Outcome(Kind.BAD_NODE, ", ".join(nodes))
    else:
        outcome = Outcome(Kind.FAILED_CHECKS, ", ".join(nodes) or "no node named")
        log.error("not excluding: %s", decision.reason)
    history = attempts.finish(state, outcome, code, decision.reason)
    log.error("%s; attempts:\n%s", decision.reason, attempts.table(history))
    raise preflight.PreflightError(f"the slot's checks failed:\n  {said}", nodes)


def _ending(plan: launch.Plan) -> bool:
    """Is SLURM ending the slot's job (continuation.ending)? Yes when scontrol cannot say: its
    kill of the job reaches every process of the job, scontrol's too."""
    try:
        return continuation.ending(
            scontrol.job_record(str(plan.job)), scontrol.node_states(plan.hosts)
        )
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("scontrol failed (%s): taking the job for ending", e)
        return True


def _lost_as(state: StateDir, job: str | None, restarts: int) -> Outcome:
    """The outcome of the last slot left open (its launcher killed: on a failed node it dies
    with the node), as SLURM tells it now (:func:`continuation.lost`); else LOST."""
    left_open = [a for a in attempts.load(state) if a.kind is Kind.RUNNING]
    if job is None or not left_open:
        return outcomes.lost()
    last = left_open[-1]
    try:
        nodes = scontrol.node_states(last.nodes)
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("scontrol show node %s failed (%s)", ",".join(last.nodes), e)
        nodes = {}
    requeued = last.job == job and restarts > last.restarts
    return continuation.lost(nodes, requeued) or outcomes.lost()


def _job_record(job: str) -> dict[str, str]:
    try:
        return scontrol.job_record(job)
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("scontrol show job %s failed (%s)", job, e)
        return {}


def _stopped(plan: launch.Plan, note: dict[str, Any], state: StateDir) -> int:
    """Training stopped on a signal after writing a checkpoint, or hung (the watchdog killed
    it; ``note["hung"]``): record why, then go on (a local slot that hung fails)."""
    request, job = plan.request, plan.job
    nodes: dict[str, str] = {}
    if job:
        try:
            nodes = scontrol.node_states(plan.hosts)
        except (OSError, subprocess.SubprocessError) as e:
            log.warning("scontrol show node failed (%s)", e)
    outcome = continuation.classify(
        note.get("signal"), _job_record(job) if job else None, nodes, request.signal_seconds,
        stop_signal=request.stop_signal,
    )  # fmt: skip
    if note.get("unfinished") and outcome.kind not in outcomes.REQUEUED_BY_SLURM:
        outcome = Outcome(Kind.ENDED_BY_SLURM)  # not on a signal of its own: SLURM ended it
    hung = note.get("hung")
    if hung and outcome.kind not in outcomes.REQUEUED_BY_SLURM:
        outcome = Outcome(Kind.HUNG)
    own_job = plan.own_job
    exit_status = HUNG_EXIT if hung and not own_job else preemption.EXIT_CODE
    history = attempts.finish(state, outcome, exit_status, hung["detail"] if hung else "")
    log.warning(
        "training stopped (%s) %s; attempts:\n%s", outcome,
        f"after writing {note['checkpoint']}" if note.get("checkpoint") else
        "without a stop checkpoint" + ("" if hung and not own_job else
                                       ": the next slot resumes from the last one"),
        attempts.table(history),
    )  # fmt: skip
    if not own_job:
        if hung:
            log.error("the slot hung: %s", hung["detail"])
        return exit_status  # 75: run it again (a packed trial: its next slot) to resume
    decision = continuation.decide(history, request.slurm.max_continuations)
    if decision.requeue:
        if _requeue(job):
            log.warning("requeued job %s: its next slot resumes from %s", job,
                        note.get("checkpoint") or "the last checkpoint")  # fmt: skip
        return preemption.EXIT_CODE
    if outcome.kind in outcomes.REQUEUED_BY_SLURM:
        log.warning("%s", decision.reason)
        return preemption.EXIT_CODE
    history[-1].detail = "; ".join(filter(None, [history[-1].detail, decision.reason]))
    history[-1].exit_status = NO_PROGRESS_EXIT  # not going on: the run ends here
    attempts.save(state, history)
    log.error("not continuing: %s", decision.reason)
    return NO_PROGRESS_EXIT


def _requeue(job: str) -> bool:
    """``scontrol requeue`` the slot's job (the launcher then exits 75); False, said in the
    log with what follows, when scontrol refuses."""
    try:
        scontrol.requeue(job)
    except (OSError, subprocess.CalledProcessError) as e:
        stderr = getattr(e, "stderr", "") or e
        log.error(
            "could not requeue job %s (%s); exiting %d: Snakemake retries the job, which "
            "uses one of its --retries", job, str(stderr).strip(), preemption.EXIT_CODE,
        )  # fmt: skip
        return False
    return True
