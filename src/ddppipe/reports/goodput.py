"""Goodput: the share of the node-seconds a run held that trained steps it kept, and where the
rest went; derived from the attempt history alone (``attempts.json``,
:class:`ddppipe.runstate.attempts.Attempt`), for the summary, its HTML and a sweep's table.

A slot holds its nodes from its start (its job's start, for the first slot of a SLURM job of its
own: :mod:`ddppipe.runstate.startup`) to its end (node-seconds: wall time x nodes); slots of
one SLURM job also hold them between one slot's end and the next one's start (a restart inside
the job). Of a slot with figures (``efficiency``), its ``train_s`` trained steps that are kept,
except the steps past the checkpoint its successor resumed from: those are trained again
(``redone``, at the slot's own seconds a step). The rest of the slot is lost to its start-up
(``startup_s``: :mod:`ddppipe.runstate.startup`'s parts before the first step), evaluation
(``evaluate_s``),
checkpoint writes that training waited for (``checkpoint_s``), the all-reduce probe
(``communication_probe_s``) and what no phase timed (the slot's idle end: after its last
step, the stop, the figures' collection, the teardown). A
slot without figures (killed, crashed, hung) kept the steps it checkpointed and its successor
resumed from, at the run's seconds a step, and redid those between that checkpoint and the
step a rank failed in (its failure record's); the rest of it is lost to the hang (the
watchdog ended it) or to the failure. A slot still open is left out until it ends.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ddppipe.reports.wording import duration
from ddppipe.runstate import outcomes
from ddppipe.runstate.outcomes import Kind

# where held node-seconds went that did not train kept steps, in the summary's order
LOSSES = {
    "startup": "start-up",
    "hang": "loader or rank hang (watchdog end)",
    "failure": "failed slot (crash, node lost, killed)",
    "restart": "restart inside the job",
    "redone": "steps redone",
    "checkpoint": "checkpoint blocking",
    "evaluation": "evaluation",
    "probe": "all-reduce probe",
    "idle_end": "idle end of a slot",
}


@dataclass(frozen=True)
class Account:
    """Node-seconds held, of them training kept steps, and the rest by :data:`LOSSES` key."""

    held: float = 0.0
    kept: float = 0.0
    losses: dict[str, float] = field(default_factory=dict)
    redone_steps: int = 0

    @property
    def share(self) -> float | None:
        """The goodput: kept / held (None when nothing was held)."""
        return self.kept / self.held if self.held > 0 else None

    def largest(self) -> tuple[str, float] | None:
        """The largest loss (key, node-seconds), None without one."""
        found = max(self.losses.items(), key=lambda kv: kv[1], default=None)
        return found if found and found[1] > 0 else None

    def __add__(self, other: Account) -> Account:
        losses = {k: self.losses.get(k, 0.0) + other.losses.get(k, 0.0) for k in LOSSES}
        some = {k: v for k, v in losses.items() if v}
        return Account(self.held + other.held, self.kept + other.kept, some,
                       self.redone_steps + other.redone_steps)  # fmt: skip


@dataclass(frozen=True)
class Run:
    """A run's account: each ended slot's (``slots``: (attempt number, account)) and the
    run's, which adds the restarts between slots of one job."""

    slots: list[tuple[int, Account]]
    total: Account


def _nodes(attempt: dict[str, Any]) -> int:
    return max(1, len(attempt.get("nodes") or []))


def _end(attempt: dict[str, Any], successor: dict[str, Any] | None) -> float | None:
    """When the slot ended: its record's end, else (a launcher killed with it) when its job
    was requeued, the successor's submission."""
    if attempt.get("end") is not None:
        return attempt["end"]
    if outcomes.kind_of(attempt) is Kind.RUNNING or successor is None:
        return None
    return successor.get("submitted")


def _kept_steps(attempt: dict[str, Any], successor: dict[str, Any] | None,
                trained: int | None) -> int:  # fmt: skip
    """Steps of ``attempt`` that the run kept: up to the step its successor resumed from, else
    (the last slot, or a successor that did not say) up to its own last checkpoint; all of
    ``trained`` (None: not known) when it recorded no steps at all."""
    start = attempt.get("start_step")
    if start is None:
        return trained or 0
    resumed = successor.get("start_step") if successor is not None else None
    if resumed is None:
        resumed = attempt.get("end_step")
    kept = 0 if resumed is None else max(0, resumed - start)
    return kept if trained is None else min(kept, trained)


def _failed_at(attempt: dict[str, Any]) -> int | None:
    """The steps a slot without figures trained, where its failure record names the step a
    rank failed in (1 for the run's first: the steps before it were done); None if not."""
    step = (attempt.get("failure") or {}).get("step")
    start = attempt.get("start_step")
    return None if step is None or start is None else max(0, step - 1 - start)


def slot(attempt: dict[str, Any], successor: dict[str, Any] | None,
         step_s: float | None) -> Account | None:  # fmt: skip
    """One slot's account; ``successor``: the slot after it (None for the last),
    ``step_s``: the run's seconds a step, for a slot without figures. None while it is open."""
    end = _end(attempt, successor)
    if end is None:
        return None
    wall, nodes = max(0.0, end - attempt["start"]), _nodes(attempt)
    figures = attempt.get("efficiency")
    if not figures:
        trained = _failed_at(attempt)
        kept = _kept_steps(attempt, successor, trained)
        redone = max(0, trained - kept) if trained is not None else 0
        kept_s = min(wall, kept * (step_s or 0.0))
        redone_s = min(wall - kept_s, redone * (step_s or 0.0))
        cause = "hang" if outcomes.kind_of(attempt) is Kind.HUNG else "failure"
        losses = {"redone": redone_s, cause: wall - kept_s - redone_s}
        return Account(wall * nodes, kept_s * nodes,
                       {k: v * nodes for k, v in losses.items() if v > 0}, redone)  # fmt: skip
    trained, train_s = int(figures.get("steps", 0)), float(figures.get("train_s", 0.0))
    kept = _kept_steps(attempt, successor, trained)
    redone_s = train_s * (trained - kept) / trained if trained else 0.0
    timed = {"startup": figures.get("startup_s", 0.0), "redone": redone_s,
             "evaluation": figures.get("evaluate_s", 0.0),
             "checkpoint": figures.get("checkpoint_s", 0.0),
             "probe": figures.get("communication_probe_s", 0.0)}  # fmt: skip
    kept_s = train_s - redone_s
    timed["idle_end"] = max(0.0, wall - kept_s - sum(timed.values()))
    if outcomes.kind_of(attempt) is Kind.HUNG:  # its last progress to the watchdog's end
        timed["hang"] = timed.pop("idle_end")
    held = max(wall, kept_s + sum(timed.values()))  # phases overlapping the slot's ends
    return Account(held * nodes, kept_s * nodes,
                   {k: v * nodes for k, v in timed.items() if v > 0}, trained - kept)  # fmt: skip


def step_seconds(attempts: Iterable[dict[str, Any]]) -> float | None:
    """The run's seconds a step: its measured slots' training time over their steps."""
    measured = [a["efficiency"] for a in attempts if a.get("efficiency")]
    steps = sum(e.get("steps", 0) for e in measured)
    return sum(e.get("train_s", 0.0) for e in measured) / steps if steps else None


def _restart(attempt: dict[str, Any], successor: dict[str, Any]) -> Account:
    """The nodes one job held between ``attempt``'s end and ``successor``'s start: a new step
    inside the same allocation (not a requeue, which waits in the queue, nor a local run's,
    nor a packed trial's: its allocation runs other trials meanwhile)."""
    job = attempt.get("job")
    same = job not in (None, "local") and job == successor.get("job")
    requeued = attempt.get("restarts", 0) != successor.get("restarts", 0)  # queued again
    if not same or requeued or attempt.get("slot") or attempt.get("end") is None:
        return Account()
    gap = max(0.0, successor["start"] - attempt["end"]) * _nodes(attempt)
    return Account(gap, 0.0, {"restart": gap} if gap else {})


def account(attempts: list[dict[str, Any]]) -> Run | None:
    """The run's goodput account; None before a slot recorded its figures (nothing to
    measure a step by)."""
    if not any(a.get("efficiency") for a in attempts):
        return None
    step_s = step_seconds(attempts)
    slots, total = [], Account()
    for i, attempt in enumerate(attempts):
        successor = attempts[i + 1] if i + 1 < len(attempts) else None
        found = slot(attempt, successor, step_s)
        if found is None:
            continue
        slots.append((attempt.get("number", i + 1), found))
        total = total + found + (_restart(attempt, successor) if successor else Account())
    return Run(slots, total) if total.held > 0 else None


def shares(attempts: list[dict[str, Any]]) -> dict[int, float]:
    """Each ended slot's goodput by its number ({} where the run has no account)."""
    run = account(attempts)
    return {n: a.share for n, a in run.slots if a.share is not None} if run else {}


def line(run: Run) -> str:
    """The summary's ``goodput`` line: the share, the largest loss, the others, each slot's."""
    total = run.total
    share = total.share or 0.0
    text = f"{share:.0%} of the {duration(total.held)} of node time held trained kept steps"
    ranked = sorted(total.losses.items(), key=lambda kv: -kv[1])
    if ranked:
        key, lost = ranked[0]
        text += f"; largest loss: {LOSSES[key]} {lost / total.held:.0%}"
        shown = [(k, v / total.held) for k, v in ranked[1:] if v / total.held >= 0.005]
        others = ", ".join(f"{LOSSES[k]} {part:.0%}" for k, part in shown)
        text += f" (then {others})" if others else ""
    if total.redone_steps:
        text += f"; {total.redone_steps} steps redone"
    if len(run.slots) > 1:
        each = ", ".join(f"{n}: {a.share or 0.0:.0%}" for n, a in run.slots)
        text += f"; by slot {each}"
    return text
