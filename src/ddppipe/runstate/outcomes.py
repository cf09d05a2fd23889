"""How a slot ends: one enumeration of the kinds, each with its variable part apart.

An attempt record (:mod:`ddppipe.runstate.attempts`) keeps its outcome as a label, the words
the reports show (``crashed (exit 1)``, ``stopped on SIGTERM``, ``bad node cn08``): a
:class:`Kind`, which code compares, and a variable part (an exit status, a signal's name,
nodes), which only the words carry. :func:`parse` reads any label back, so the records of
earlier versions load as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class Kind(StrEnum):
    """How a slot ended (the value: its label, or the label's fixed part)."""

    RUNNING = "running"  # not ended yet (its launcher holds the record open)
    COMPLETED = "completed"
    TIME_LIMIT = "time limit"  # stopped on the launcher's warning before the job's end
    STOPPED = "stopped on"  # a user's signal, or one SLURM did not explain: "stopped on SIGTERM"
    PREEMPTED = "preempted"
    NODE_FAILURE = "node failure"
    REQUEUED_BY_SLURM = "requeued by SLURM"
    ENDED_BY_SLURM = "ended by SLURM"  # srun exited 0 without every node's finished mark
    HUNG = "hung"  # the watchdog's (ddppipe.launching.watchdog)
    CRASHED = "crashed"  # "crashed (exit 1)"
    OUT_OF_MEMORY = "out of memory"
    KILLED = "killed by"  # "killed by SIGKILL"
    NOT_FINITE = "non-finite loss"  # "non-finite loss at step 8 (epoch 1)"
    BAD_NODE = "bad node"  # "bad node cn08, cn09": failed its checks, excluded
    FAILED_CHECKS = "failed its checks"  # "failed its checks (cn08)": not excluded
    RENDEZVOUS_TIMEOUT = "rendezvous timeout"
    RENDEZVOUS_FAILED = "rendezvous failed"  # "rendezvous failed (RendezvousClosedError)"
    LOST = "lost"  # its launcher was killed before it could say


# The labels of the kinds with a variable part ("{}"); the others' label is their value.
_LABELS = {
    Kind.STOPPED: "stopped on {}",
    Kind.CRASHED: "crashed (exit {})",
    Kind.KILLED: "killed by {}",
    Kind.NOT_FINITE: "non-finite loss {}",
    Kind.BAD_NODE: "bad node {}",
    Kind.FAILED_CHECKS: "failed its checks ({})",
    Kind.RENDEZVOUS_FAILED: "rendezvous failed ({})",
    Kind.LOST: "lost ({})",
}
LOST_WHY = "the launcher was killed: node failure, out of memory or SIGKILL"
# The kinds after which SLURM requeues the job itself (it was submitted with --requeue).
REQUEUED_BY_SLURM = frozenset(
    {Kind.PREEMPTED, Kind.NODE_FAILURE, Kind.REQUEUED_BY_SLURM, Kind.ENDED_BY_SLURM}
)
# The kinds of a slot that stopped and goes on in a next slot (exit 75), unless a budget is
# spent (ddppipe.runstate.restarts).
GOES_ON = REQUEUED_BY_SLURM | {Kind.TIME_LIMIT, Kind.STOPPED, Kind.HUNG}
# The kinds of a failure of the training itself (a rank's record names it).
FAILED = frozenset({Kind.CRASHED, Kind.OUT_OF_MEMORY, Kind.KILLED, Kind.NOT_FINITE,
                    Kind.RENDEZVOUS_TIMEOUT, Kind.RENDEZVOUS_FAILED})  # fmt: skip

# The kinds whose failure's cause (the record's detail) names them itself: "out of memory on
# rank 1 ...", "rank 0 (cn08) killed by SIGKILL ...", "non-finite loss at step 8 (epoch 1)".
SAID_BY_CAUSE = frozenset({Kind.OUT_OF_MEMORY, Kind.KILLED, Kind.NOT_FINITE})


class OutcomeError(ValueError):
    """A label that names no :class:`Kind`."""


@dataclass(frozen=True, eq=False)
class Outcome:
    """A slot's end: its ``kind`` and the variable part of its label (``part``, "" if none).
    It equals another outcome or a label (a record's text) of the same words."""

    kind: Kind
    part: str = ""

    def __post_init__(self) -> None:
        if (self.kind in _LABELS) != bool(self.part):
            has = "needs" if self.kind in _LABELS else "has none"
            raise OutcomeError(f"outcome {self.kind.name}: a variable part {has} ({self.part!r})")

    @property
    def label(self) -> str:
        """The words of the attempt record and the reports: ``crashed (exit 1)``."""
        return _LABELS[self.kind].format(self.part) if self.kind in _LABELS else str(self.kind)

    def __str__(self) -> str:
        return self.label

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Outcome | str):
            return self.label == str(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.label)


def crashed(code: int) -> Outcome:
    return Outcome(Kind.CRASHED, str(code))


def stopped(signal_name: str, why: str = "") -> Outcome:
    """Stopped on ``signal_name`` (``why``: what is known of its cause, in words)."""
    return Outcome(Kind.STOPPED, f"{signal_name} ({why})" if why else signal_name)


def lost() -> Outcome:
    return Outcome(Kind.LOST, LOST_WHY)


def parse(label: str) -> Outcome:
    """The outcome of ``label`` (this version's or an earlier one's record); OutcomeError when it
    names no kind."""
    for kind in Kind:
        template = _LABELS.get(kind)
        if template is None:
            if label == kind.value:
                return Outcome(kind)
            continue
        head, _, tail = template.partition("{}")
        if label.startswith(head) and label.endswith(tail) and len(label) > len(head + tail):
            return Outcome(kind, label[len(head) : len(label) - len(tail)])
    known = ", ".join(repr(_LABELS.get(k, k.value)) for k in Kind)
    raise OutcomeError(f"unknown slot outcome {label!r}: one of {known} expected")


def kind_of(attempt: dict[str, Any]) -> Kind:
    """The kind of an attempt record's outcome (``attempts.json``'s dict; "running" if none)."""
    return parse(attempt.get("outcome") or Kind.RUNNING.value).kind
