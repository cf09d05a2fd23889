"""One slot's life, decided in one place: ``step(slot, event) -> (slot, actions)``.

Pure: no process, no file, no SLURM call. The launcher posts the events (the timer's warning,
a signal to the launcher, the watchdog's hang, the node watch's lost node, the step's exit
with what SLURM and the state folder said of it) through one queue drained by one thread
(:func:`ddppipe.launching.launch.supervise`), and carries the actions out in one place
(:mod:`ddppipe.launching.launch` during the step, :mod:`ddppipe.launching.lifecycle` at its
end): those are the only callers of SLURM and hold the only try/except around it.

A slot is RUNNING until the launcher ends its step (ENDING: a hang, a lost node; a second
such cause is ignored, so no two threads kill the step) or it exits (ENDED). How it ended
is the first of :data:`CAUSES` that holds.
"""

from __future__ import annotations

import logging
import signal
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from typing import Any

from ddppipe.parallel import node_check
from ddppipe.runstate import outcomes, preemption, restarts
from ddppipe.runstate.attempts import Attempt
from ddppipe.runstate.failures import Failure
from ddppipe.runstate.outcomes import Kind, Outcome
from ddppipe.slurm import bad_nodes, scontrol

NO_PROGRESS_EXIT = 1  # a SLURM run that stopped making progress or reached its continuations
HUNG_EXIT = 1  # a local slot that hung (ddppipe.launching.watchdog)
# The warning arrives signal_seconds before the end; the stop then takes some seconds more.
TIME_LIMIT_SLACK_S = 30
# States of a job that SLURM has put back in the queue (its nodes' states may be unknown).
REQUEUED_STATES = ("PENDING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD")
# The outcome of a stop whose job SLURM could not say (its query failed): not a time limit, not a
# user's signal either.
UNKNOWN_CAUSE = "cause unknown: scontrol show job failed"


class Phase(StrEnum):
    RUNNING = "running"
    ENDING = "ending"
    ENDED = "ended"


PHASES = {
    Phase.RUNNING: "the step runs; a warning or a signal is passed on to it",
    Phase.ENDING: "the launcher ends the step (a hang, a lost node); a second such cause is "
    "ignored, a signal still passed on",
    Phase.ENDED: "the step exited; the slot's end is decided and carried out, once",
}


# The order of end causes: the first that holds names the slot's end.
CAUSES = (
    ("failed checks", "the step failed and a node's own checks named it (srun's stderr)"),
    ("lost node", "the node watch lost a node, unless every rank had finished"),
    ("hung", "the watchdog found no progress and ended the step"),
    ("stopped", "the ranks stopped on a signal after a checkpoint (their stop note)"),
    ("unfinished", "srun exited 0 without a node's finished mark, SLURM ending the job"),
    ("completed", "the step exited 0"),
    ("failed node", "the step failed and SLURM sees a node of it failed"),
    ("failed", "the training failed: its first failing rank's record names how"),
)


@dataclass(frozen=True)
class SlotState:
    """What the slot's decisions depend on: its step's place and settings, and its phase."""

    job: str | None  # its SLURM job; None for a local slot
    own_job: bool  # a job of its own (not a packed trial's allocation)
    hosts: tuple[str, ...]
    goes_on_in_job: bool = False  # slurm.spare_nodes or slurm.min_nodes: a next step in the job
    stop_signal: str = "SIGUSR1"
    signal_seconds: int = 0
    max_continuations: int = 0
    max_excluded_nodes: int = 0
    phase: Phase = Phase.RUNNING
    ending: str | None = None  # why the launcher ends the step: "hung" or "lost"
    exit_status: int | None = None  # the launcher's, once ENDED


# -- events ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Warned:
    """The launcher's timer: the time-limit warning is due."""


@dataclass(frozen=True)
class Signalled:
    """The launcher's signal handler: it got ``signum`` (a user's, SLURM's preemption)."""

    signum: int


@dataclass(frozen=True)
class Hung:
    """The watchdog: the ranks hung, their stacks are dumped (``beats``: their last)."""

    beats: tuple[Any, ...] = ()


@dataclass(frozen=True)
class NodeLost:
    """The node watch: a node of the step is lost."""


@dataclass(frozen=True)
class Facts:
    """What the launcher found as the step ended: the run's ``history`` (this slot's record
    open and last, its progress in), the first failing rank's record, the job's scontrol
    record (None: outside SLURM or not asked; empty: the query failed) and its nodes' states,
    the nodes excluded so far, the note of a script the watchdog could not watch, and when
    SLURM was asked (``now``, Unix time: a stop near the job's end is its time limit's)."""

    history: tuple[Attempt, ...]
    failure: Failure | None = None
    job: dict[str, str] | None = None
    node_states: dict[str, str] = field(default_factory=dict)
    excluded: tuple[str, ...] = ()
    unwatched: str = ""
    now: float | None = None


@dataclass(frozen=True)
class Exited:
    """The step's waiter: it exited with ``code``, with what the launcher found (``note``:
    the ranks' stop note, ``hung``, ``lost``, ``unfinished``; ``checks``: its nodes' failed
    checks' lines; ``facts``)."""

    code: int
    note: dict[str, Any] | None
    facts: Facts
    checks: tuple[str, ...] = ()


Event = Warned | Signalled | Hung | NodeLost | Exited

# -- actions --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Say:
    level: int
    text: str


@dataclass(frozen=True)
class Forward:
    """Pass ``signum`` on to the step (if it still runs)."""

    signum: int


@dataclass(frozen=True)
class EndStep:
    """Kill the step: its ranks hung (``why`` "hung"), or a node of it was lost ("lost")."""

    why: str
    beats: tuple[Any, ...] = ()


@dataclass(frozen=True)
class RecordBadNodes:
    """Save the run's bad-node record: ``nodes``, all of them."""

    nodes: tuple[str, ...]


@dataclass(frozen=True)
class Publish:
    """Training is complete: publish the run's results."""


@dataclass(frozen=True)
class Finish:
    """Close the slot's attempt record (written once), then say ``said`` and the history."""

    outcome: Outcome
    exit_status: int
    detail: str = ""
    failure: dict[str, Any] | None = None
    said: str = ""
    level: int = logging.WARNING
    copy: bool = False  # also the train rule's copy of the history (training complete)


@dataclass(frozen=True)
class Finalize:
    """Record ``failure`` as the run's end for its config (``why``): a retry refuses to train."""

    failure: Failure
    why: str


@dataclass(frozen=True)
class Requeue:
    """``scontrol requeue`` the slot's job: its next slot resumes from ``resumes_from``."""

    job: str
    resumes_from: str


@dataclass(frozen=True)
class Refuse:
    """End the launcher with a PreflightError: ``message``, naming ``nodes``."""

    message: str
    nodes: tuple[str, ...]


@dataclass(frozen=True)
class GoOn:
    """Start the next step in the same job without ``nodes`` (a spare in their place, or
    fewer nodes down to slurm.min_nodes); ``otherwise``: when too few nodes are left."""

    nodes: tuple[str, ...]
    otherwise: Requeue | Refuse


Action = Say | Forward | EndStep | RecordBadNodes | Publish | Finish | Finalize | Requeue | Refuse
Action = Action | GoOn


def step(slot: SlotState, event: Event) -> tuple[SlotState, list[Action]]:
    """The slot after ``event``, and what the launcher is to do."""
    if isinstance(event, Warned):
        if slot.phase is not Phase.RUNNING:
            return slot, []
        sig = signal.Signals[slot.stop_signal]
        return slot, [Say(logging.WARNING, f"time-limit warning: {sig.name} to the training"),
                      Forward(sig)]  # fmt: skip
    if isinstance(event, Signalled):
        return slot, [] if slot.phase is Phase.ENDED else [Forward(event.signum)]
    if isinstance(event, Hung | NodeLost):
        if slot.phase is not Phase.RUNNING:  # the step is ending already: one end at a time
            return slot, []
        why = "hung" if isinstance(event, Hung) else "lost"
        beats = event.beats if isinstance(event, Hung) else ()
        return replace(slot, phase=Phase.ENDING, ending=why), [EndStep(why, beats)]
    return _end(slot, event)


def _end(slot: SlotState, ev: Exited) -> tuple[SlotState, list[Action]]:
    """The step exited: the first of :data:`CAUSES` that holds."""
    code, note, facts = ev.code, ev.note, ev.facts
    if code != 0 and slot.own_job and ev.checks:
        return _failed_checks(slot, list(ev.checks), code, facts)
    if note is not None and note.get("lost"):
        return _node_lost(slot, note, facts)
    said: list[Action] = []
    if note is not None and note.get("hung"):
        note = {"signal": None, "checkpoint": None, "hung": note["hung"]}
    elif note is not None and note.get("unfinished") and not ending(facts):
        said.append(Say(logging.WARNING, (
            f"no finished mark from {', '.join(note['unfinished'])}, but SLURM runs the job "
            "on working nodes: srun's exit 0 stands (the state folder's filesystem shows "
            "other nodes' files late?)")))  # fmt: skip
        note = None
    if note is not None:
        return _stopped(slot, note, facts, said)
    if code == 0:
        done = Finish(Outcome(Kind.COMPLETED), 0, facts.unwatched, said="training complete",
                      level=logging.INFO, copy=True)  # fmt: skip
        return _ended(slot, 0), [*said, Publish(), done]
    failed = scontrol.failed_nodes(facts.node_states) if slot.job else []
    if failed:  # SLURM ended the step for a node's failure: no crash of the user's code
        return _stopped(slot, {"signal": None, "checkpoint": None, "unfinished": failed}, facts)
    return _failed(slot, code, facts)


def ending(facts: Facts) -> bool:
    """Is SLURM ending the job (:func:`~ddppipe.slurm.scontrol.ending`)? Yes when scontrol
    could not say: its kill of the job reaches every process of it, scontrol's too."""
    return scontrol.ending(facts.job or {}, facts.node_states)


def asks_slurm(slot: SlotState, code: int, note: dict[str, Any] | None,
               checks: list[str]) -> bool:  # fmt: skip
    """Does the end of a step that exited ``code`` with ``note`` and ``checks`` depend on what
    SLURM says of its job and nodes (:class:`Facts`)? Only in a SLURM job, and not for an exit
    0 with nothing to explain, a node's failed checks or a lost node (:data:`CAUSES`)."""
    if slot.job is None or (code == 0 and note is None):
        return False
    return not (code != 0 and slot.own_job and checks) and not (note and note.get("lost"))


def may_be_lost(code: int, note: dict | None, seen_lost: bool) -> bool:
    """Is a lost node to be asked about as the step's end (exit ``code``, its stop ``note``
    so far, a node ``seen_lost`` by the node watch)? Never for a finished slot (exit 0, every
    node's finished mark, no stop: ``note`` None), whatever its nodes did after; else when a
    node was seen lost, the step failed, or a node's finished mark is missing."""
    if code == 0 and note is None:
        return False
    return seen_lost or code != 0 or bool(note and note.get("unfinished"))


def _ended(slot: SlotState, exit_status: int) -> SlotState:
    return replace(slot, phase=Phase.ENDED, exit_status=exit_status)


def _closed(history: tuple[Attempt, ...], outcome: Outcome, exit_status: int) -> list[Attempt]:
    """``history`` with its open record closed as ``outcome`` (what the record will say)."""
    return [*history[:-1], replace(history[-1], outcome=outcome.label, exit_status=exit_status)]


def _stopped(
    slot: SlotState, note: dict[str, Any], facts: Facts, said: list[Action] | None = None
) -> tuple[SlotState, list[Action]]:
    """Training stopped on a signal after writing a checkpoint, or hung (``note["hung"]``),
    or SLURM ended its step: why, and whether the job goes on (a local slot that hung fails)."""
    outcome = classify(
        note.get("signal"), facts.job if slot.job else None, facts.node_states,
        slot.signal_seconds, facts.now, stop_signal=slot.stop_signal,
    )  # fmt: skip
    if note.get("unfinished") and outcome.kind not in outcomes.REQUEUED_BY_SLURM:
        outcome = Outcome(Kind.ENDED_BY_SLURM)  # not on a signal of its own: SLURM ended it
    hung = note.get("hung")
    if hung and outcome.kind not in outcomes.REQUEUED_BY_SLURM:
        outcome = Outcome(Kind.HUNG)
    fails = bool(hung) and not slot.own_job
    exit_status = HUNG_EXIT if fails else preemption.EXIT_CODE
    checkpoint = note.get("checkpoint")
    words = f"training stopped ({outcome}) " + (
        f"after writing {checkpoint}" if checkpoint else "without a stop checkpoint"
        + ("" if fails else ": the next slot resumes from the last one"))  # fmt: skip
    detail = hung["detail"] if hung else ""
    actions = list(said or [])
    if not slot.own_job:
        actions.append(Finish(outcome, exit_status, detail, said=words))
        if hung:
            actions.append(Say(logging.ERROR, f"the slot hung: {hung['detail']}"))
        return _ended(slot, exit_status), actions  # 75: run it again (a packed trial too)
    closed = _closed(facts.history, outcome, exit_status)
    decision = decide(closed, slot.max_continuations)
    if decision.requeue:
        assert slot.job is not None
        return _ended(slot, exit_status), [*actions, Finish(outcome, exit_status, detail,
            said=words), Requeue(slot.job, checkpoint or "the last checkpoint")]  # fmt: skip
    if outcome.kind in outcomes.REQUEUED_BY_SLURM:
        return _ended(slot, exit_status), [*actions, Finish(outcome, exit_status, detail,
            said=words), Say(logging.WARNING, decision.reason)]  # fmt: skip
    detail = "; ".join(filter(None, [detail, decision.reason]))
    return _ended(slot, NO_PROGRESS_EXIT), [  # not going on: the run ends here
        *actions, Finish(outcome, NO_PROGRESS_EXIT, detail, said=words),
        Say(logging.ERROR, f"not continuing: {decision.reason}"),
    ]  # fmt: skip


def _node_lost(
    slot: SlotState, note: dict[str, Any], facts: Facts
) -> tuple[SlotState, list[Action]]:
    """The step lost ``note["lost"]``: recorded as bad (the run's later submissions exclude
    them), the slot closed as "node failure", the job going on without them."""
    lost = list(note["lost"])
    decision = bad_nodes.decide(lost, list(slot.hosts), list(facts.excluded),
                                slot.max_excluded_nodes, bad_nodes.NEXT_STEPS,
                                bad_nodes.LOST)  # fmt: skip
    assert slot.job is not None
    return _ended(slot, preemption.EXIT_CODE), [
        *([RecordBadNodes(tuple(decision.excluded))] if decision.excluded else []),
        Finish(Outcome(Kind.NODE_FAILURE), preemption.EXIT_CODE,
               f"{note.get('detail')}; {decision.reason}", said=f"lost {', '.join(lost)}",
               level=logging.ERROR),
        GoOn(tuple(lost), Requeue(slot.job, "the last checkpoint")),
    ]  # fmt: skip


def _failed_checks(
    slot: SlotState, lines: list[str], code: int, facts: Facts
) -> tuple[SlotState, list[Action]]:
    """Nodes of the slot failed their own checks (``lines``: what they said): recorded as bad
    where they are some of the slot's nodes, the attempt closed; the job goes on without them
    (a spare, or fewer nodes) where it can, else the launcher ends with a PreflightError."""
    nodes = node_check.failing_nodes("\n".join(lines), list(slot.hosts))
    decision = bad_nodes.decide(nodes, list(slot.hosts), list(facts.excluded),
                                slot.max_excluded_nodes)  # fmt: skip
    said = "\n  ".join(dict.fromkeys(line.removeprefix(node_check.PREFIX) for line in lines))
    refuse = Refuse(f"the slot's checks failed:\n  {said}", tuple(nodes))
    actions: list[Action] = []
    if decision.excluded:
        outcome = Outcome(Kind.BAD_NODE, ", ".join(nodes))
        actions.append(RecordBadNodes(tuple(decision.excluded)))
    else:
        outcome = Outcome(Kind.FAILED_CHECKS, ", ".join(nodes) or "no node named")
        actions.append(Say(logging.ERROR, f"not excluding: {decision.reason}"))
    actions.append(Finish(outcome, code, decision.reason, said=decision.reason,
                          level=logging.ERROR))  # fmt: skip
    goes_on = slot.goes_on_in_job and bool(decision.excluded)
    actions.append(GoOn(tuple(nodes), refuse) if goes_on else refuse)
    return _ended(slot, code), actions


def _failed(slot: SlotState, code: int, facts: Facts) -> tuple[SlotState, list[Action]]:
    """Training failed: its first failure named in the attempt record and the log; a
    non-finite loss, or the same failure as the slot before, ends the run for good
    (:data:`ddppipe.runstate.restarts.RESTARTS`)."""
    failure = facts.failure
    if failure is None:  # no rank recorded an exception: killed (SIGKILL, out of memory)
        return _ended(slot, code), [Finish(outcome=outcomes.crashed(code), exit_status=code)]
    detail = failure.cause()
    shown = ""
    if failure.traceback and not failure.nonfinite:  # a killed rank: no traceback
        shown = (f"\nthe first failure's traceback (rank {failure.rank} on {failure.host}):\n"
                 f"{failure.traceback}")  # fmt: skip
    actions: list[Action] = [Say(logging.ERROR, f"training failed: {detail}{shown}")]
    before = facts.history[-2].failure if len(facts.history) > 1 else None
    final = restarts.ends_run(failure, Failure(**before) if before else None,
                              len(facts.history))  # fmt: skip
    if final is not None and not failure.nonfinite:  # a non-finite loss's outcome says it all
        detail += f" ({final}: not retried)"
    actions.append(Finish(failure.outcome(), code, detail, asdict(failure)))
    if final is not None:
        actions += [Finalize(failure, final), Say(logging.ERROR, f"not retrying: {final}")]
    return _ended(slot, code), actions


# -- after a stop: why, and whether the job goes on ------------------------------------------
#
# A stop on the time-limit warning (the launcher's SIGUSR1) or on a user's ``scancel --signal``
# continues by requeueing the job itself (``scontrol requeue``, as submitit and Lightning do):
# the same job id goes back to the queue and gets a fresh time slot, and the Snakemake SLURM
# plugin, which sees a PENDING or RUNNING job, keeps waiting; its ``retries`` stay for real
# failures. Preemption and node failures are requeued by SLURM itself (``--requeue``). A slot
# that checkpointed no new step, or a run past ``slurm.max_continuations``, fails instead of
# looping.


def classify(
    signal_name: str | None,
    job: dict[str, str] | None,
    nodes: dict[str, str],
    signal_seconds: int,
    now: float | None = None,
    stop_signal: str = "SIGUSR1",
) -> Outcome:
    """How a slot that stopped on ``signal_name`` ended, from what SLURM says right after.

    ``job`` is the job's scontrol record (None outside SLURM; empty: its query failed, the
    cause is unknown), ``nodes`` its nodes' states (a drained node is no failure).
    """
    signal_name = signal_name or "a signal"
    if job is None:
        return outcomes.stopped(signal_name)
    if scontrol.failed_nodes(nodes):
        return Outcome(Kind.NODE_FAILURE)
    if not job:
        return outcomes.stopped(signal_name, UNKNOWN_CAUSE)
    if job.get("JobState") == "PREEMPTED" or "preempt" in job.get("Reason", "").lower():
        return Outcome(Kind.PREEMPTED)
    if job.get("JobState") in REQUEUED_STATES:
        return Outcome(Kind.REQUEUED_BY_SLURM)
    left = scontrol.seconds_left(job, now)
    near_end = left is not None and left <= signal_seconds + TIME_LIMIT_SLACK_S
    if signal_name == stop_signal and near_end:
        return Outcome(Kind.TIME_LIMIT)
    return outcomes.stopped(signal_name)


def lost(nodes: dict[str, str], requeued: bool) -> Outcome | None:
    """How a slot whose launcher was killed before it could say ended, as SLURM tells it at
    the next slot: its nodes' states ``nodes`` (a node failed: "node failure", the launcher
    died with it; a drained one alone kills no launcher, nor one expected to fail), or its
    job ``requeued`` since (same job, more restarts); None when SLURM says neither."""
    if scontrol.failed_nodes(nodes):
        return Outcome(Kind.NODE_FAILURE)
    return Outcome(Kind.REQUEUED_BY_SLURM) if requeued else None


@dataclass(frozen=True)
class Decision:
    """Whether the job should requeue itself, and why not when it should not."""

    requeue: bool
    reason: str


def decide(history: list[Attempt], max_continuations: int) -> Decision:
    """Requeue after the last slot of ``history`` (which stopped on a signal)?

    A slot whose progress is unknown (a script that logged no step) continues, bounded by
    ``max_continuations``. A slot that hung without checkpointing a new step continues once;
    a second such slot in a row fails the run. A slot that went on in its job after a lost
    node (:func:`after_lost_node`) continues too: its time was what the lost slot left.
    """
    last = history[-1]
    if last.kind in outcomes.REQUEUED_BY_SLURM:
        return Decision(False, f"{last.outcome}: SLURM requeues the job itself")
    if last.kind is Kind.HUNG and last.steps <= 0:  # (ddppipe.launching.watchdog)
        before = history[-2] if len(history) > 1 else None
        if before is not None and before.kind is Kind.HUNG and before.steps <= 0:
            return Decision(
                False,
                f"slots {before.number} and {last.number} hung without checkpointing a new "
                "step: not continuing. The attempt history names the ranks and frames, the "
                "state folder's hangs/ has every rank's stack",
            )  # one more slot after a hang without progress, which may have been transient
    elif last.start_step is not None and last.steps <= 0 and not after_lost_node(history):
        return Decision(
            False,
            f"no progress: slot {last.number} (job {last.job}) checkpointed no new step "
            f"(it resumed from {last.resumed_from or 'the start'}). The time left after "
            "start-up is too short for one checkpoint interval: raise slurm.runtime, or lower "
            "slurm.signal_seconds if the warning comes long before the checkpoint is needed",
        )
    requeues = sum(1 for a in history[:-1] if a.job == last.job)
    if requeues >= max_continuations:
        return Decision(
            False,
            f"slurm.max_continuations ({max_continuations}) reached: job {last.job} ran "
            f"{requeues + 1} slots; raise slurm.max_continuations or slurm.runtime",
        )
    return Decision(True, "")


def after_lost_node(history: list[Attempt]) -> bool:
    """Did the last slot of ``history`` go on in its job (the same job and restart) after the
    slot before it lost a node (``slurm.spare_nodes``, ``slurm.min_nodes``)?"""
    if len(history) < 2:
        return False
    before, last = history[-2], history[-1]
    same_slot_of_job = (before.job, before.restarts) == (last.job, last.restarts)
    return same_slot_of_job and before.kind is Kind.NODE_FAILURE
