"""A sweep's trials as they stand: how each ended (completed, pruned at epoch E, failed: its
cause, running, pending), its values, the metric and what it cost, ranked by the metric
(:class:`Table`); rendered by :mod:`ddppipe.sweeps.table`.

Read from each trial's run folder with what the run's summary reads
(:mod:`ddppipe.reports.run_files`: its config, per-epoch metrics and attempt history, from the
state folder while it trains or after it failed) and its final evaluation; the cost as the
summary counts it (:class:`ddppipe.reports.hours.Cost`). Only files: no torch, no SLURM.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddppipe.reports import result_lines, run_files, slurm_accounting
from ddppipe.reports.hours import Cost
from ddppipe.runstate import outcomes
from ddppipe.runstate.outcomes import Kind
from ddppipe.settings import layout
from ddppipe.settings.sweep import Sweep, trials
from ddppipe.training.loop.pruning import PRUNED_AT, history_key

COMPLETED, PRUNED, FAILED, RUNNING, PENDING = "completed", "pruned", "failed", "running", "pending"
OUTCOMES = (COMPLETED, PRUNED, FAILED, RUNNING, PENDING)  # the counts, in this order


def document(found: Sweep) -> dict[str, Any]:
    """The sweep's definition and its trials known now: ``sweep.json`` (rule sweep_trials),
    and what the table lists."""
    return {
        "name": found.name,
        "definition": found.definition(),
        "metric": found.metric,
        "direction": found.direction,
        "max_parallel": found.max_parallel,
        "prune": found.prune,
        "trials": [{"name": t.name, "run": t.run, "values": dict(t.values)} for t in trials(found)],
    }


def metric_value(record: Mapping[str, Any], metric: str) -> float | None:
    """The metric ``metric`` in an evaluation or epoch record: a task's ``test_<metric>``
    (``accuracy`` is ``test_accuracy``), else the key itself (a script's logged name)."""
    value = record.get(history_key(metric), record.get(metric))
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class TrialResult:
    """What one trial's run left: how it ended, the metric, its speed and cost."""

    name: str
    values: Mapping[str, Any]
    layout: layout.RunLayout
    kind: layout.RunKind
    outcome: str  # completed | pruned | failed | running | pending
    detail: str  # the epoch a pruned trial stopped at; the cause of a failure
    final: float | None  # the metric of the final evaluation (completed, pruned)
    best: float | None  # the best of its epochs
    best_epoch: int | None
    epochs: int  # epochs (a script: logged records) finished
    reached: Mapping[float, float | None]  # seconds to each accuracy target (None: not reached)
    images_per_s: float | None
    cost: Cost | None
    history: Sequence[Mapping[str, Any]] = field(default=(), repr=False)  # per epoch

    @property
    def ranked(self) -> bool:
        """Whether the metric ranks it: it completed or was pruned, with the metric."""
        return self.outcome in (COMPLETED, PRUNED) and self.final is not None

    @property
    def outcome_text(self) -> str:
        """``completed``, ``pruned at epoch E``, ``failed: <cause>``, ``running``, ``pending``."""
        if self.outcome == PRUNED:
            return f"pruned at epoch {self.detail}"
        if self.outcome == FAILED:
            return f"failed: {self.detail}"
        return self.outcome

    def files(self) -> dict[str, str | None]:
        """Where its model (the export) and its provenance are (None: not there)."""
        export = self.layout.export
        return {
            "model": _existing(export.result(self.kind)),
            "provenance": _existing(export.provenance),
            "config": _existing(self.layout.config),
        }


def _existing(path: Path) -> str | None:
    return str(path) if path.exists() else None


def _evaluation(files: run_files.RunFiles, run: layout.RunLayout) -> dict[str, Any] | None:
    """The final evaluation: a task's (the training's own), else a script's last logged
    values (the evaluate rule's); None: none yet."""
    if files.evaluation:
        return files.evaluation
    try:
        return dict(json.loads(run.eval.metrics.read_text()))
    except FileNotFoundError:
        return None


def _error(path: Path) -> str:
    """The error a failed command's log ends with: the text after its ``error:`` and the
    indented lines below it (the keys at fault), else the log's last line."""
    lines = path.read_text(errors="replace").splitlines()
    at = next((i for i, line in enumerate(lines) if "error:" in line), None)
    if at is None:
        found = next((line.strip() for line in reversed(lines) if line.strip()), "")
    else:
        more = [line.strip() for line in lines[at + 1 :] if line[:1].isspace() and line.strip()]
        found = " ".join([lines[at].split("error:", 1)[1].strip(), *more])
    return found if len(found) <= 300 else found[:297] + "..."


def _ending(
    files: run_files.RunFiles, run: layout.RunLayout, evaluation: dict[str, Any] | None
) -> tuple[str, str]:
    """(outcome, detail) of the trial ``run`` from its evaluation and its attempt history."""
    if evaluation is not None:
        if evaluation.get(PRUNED_AT) is not None:
            return PRUNED, str(evaluation[PRUNED_AT])
        return COMPLETED, ""
    if files.early_failure is not None:  # its last job died before training
        return FAILED, files.early_failure.text()
    attempts = files.attempts
    if not attempts:
        log = run.log("write_config")
        if files.about.configured or not log.exists():
            return PENDING, ""
        return FAILED, f"write_config: {_error(log)} ({log})"
    last = attempts[-1]
    kind = outcomes.kind_of(last)
    if kind is Kind.RUNNING:
        return RUNNING, ""
    if kind is Kind.COMPLETED:  # trained, but no evaluation: the evaluate rule failed
        return FAILED, f"trained, but not evaluated (see {run.log('evaluate')})"
    detail = last.get("detail") or ""
    if kind in outcomes.SAID_BY_CAUSE and detail:  # "out of memory on rank 1 ..."
        return FAILED, detail
    return FAILED, last["outcome"] + (f": {detail}" if detail else "")


def read_trial(
    name: str, values: Mapping[str, Any], run: layout.RunLayout, metric: str, minimize: bool
) -> TrialResult:
    """The result of the trial ``name`` whose run is ``run`` (``minimize``: lower ``metric``
    is better)."""
    files = run_files.load(run.root)
    evaluation = _evaluation(files, run)
    outcome, detail = _ending(files, run, evaluation)
    history = files.history
    scored = [(v, r) for r in history if (v := metric_value(r, metric)) is not None]
    best = (min if minimize else max)(scored, key=lambda s: s[0]) if scored else None
    origin = slurm_accounting.origin(files.attempts, None)
    reached: dict[float, float | None] = {}
    for target in files.about.accuracy_targets:
        record = result_lines.first_reaching(history, target)
        reached[target] = record["time"] - origin[0] if record and origin else None
    speeds = history and all("images_per_s" in r for r in history)
    return TrialResult(
        name=name, values=values, layout=run, kind=files.about.kind, outcome=outcome,
        detail=detail, final=metric_value(evaluation, metric) if evaluation else None,
        best=best[0] if best else None,
        best_epoch=best[1].get("epoch", best[1].get("step")) if best else None,
        epochs=len(history), reached=reached,
        images_per_s=result_lines.images_per_s(history) if speeds else None,
        cost=Cost.of(files.about.spec, files.attempts), history=history,
    )  # fmt: skip


@dataclass(frozen=True)
class Table:
    """A sweep's trials, best first."""

    sweep: str
    metric: str
    direction: str
    keys: tuple[str, ...]
    targets: tuple[float, ...]
    trials: tuple[TrialResult, ...]  # ranked trials by the metric, then the others by name
    layout: layout.SweepLayout

    @property
    def counts(self) -> dict[str, int]:
        found = Counter(t.outcome for t in self.trials)
        return {o: found.get(o, 0) for o in OUTCOMES}

    @property
    def minimize(self) -> bool:
        return self.direction == "minimize"

    def best(self) -> TrialResult | None:
        """The best completed trial by the metric (a pruned one only when none completed)."""
        ranked = [t for t in self.trials if t.ranked]
        done = [t for t in ranked if t.outcome == COMPLETED]
        return (done or ranked or [None])[0]

    def per_hour(self, trial: TrialResult) -> float | None:
        """The metric per allocated hour (maximize: metric / hours held) or, minimizing, the
        metric times the hours held: what ranks the cheapest good trial."""
        if trial.final is None or trial.cost is None or not trial.cost.held_h:
            return None
        held = trial.cost.held_h
        return trial.final * held if self.minimize else trial.final / held

    def best_per_hour(self) -> TrialResult | None:
        """The best completed trial by the metric per allocated hour."""
        scored = [(p, t) for t in self.trials
                  if t.outcome == COMPLETED and (p := self.per_hour(t)) is not None]  # fmt: skip
        if not scored:
            return None
        pick = min if self.minimize else max
        return pick(scored, key=lambda s: s[0])[1]


def collect(doc: Mapping[str, Any], results: Path) -> Table:
    """Every trial of the sweep ``doc`` (sweep.json's content) from its run folder under
    ``results``, ranked best first by the metric."""
    metric, minimize = doc["metric"], doc["direction"] == "minimize"
    found = [
        read_trial(t["name"], t["values"], layout.RunLayout(t["run"], results), metric, minimize)
        for t in doc["trials"]
    ]
    sign = 1.0 if minimize else -1.0
    ranked = sorted((t for t in found if t.ranked), key=lambda t: (sign * (t.final or 0), t.name))
    rest = sorted((t for t in found if not t.ranked),
                  key=lambda t: (OUTCOMES.index(t.outcome), t.name))  # fmt: skip
    targets = sorted({target for t in found for target in t.reached})
    return Table(doc["name"], metric, doc["direction"], tuple(doc["definition"]["keys"]),
                 tuple(targets), tuple(ranked + rest),
                 layout.SweepLayout(doc["name"], results))  # fmt: skip


def load(sweep_json: Path) -> Table:
    """The table of the sweep whose ``sweep.json`` is ``sweep_json``
    (``<results>/sweeps/<name>/sweep.json``: its trials' runs are under ``<results>``)."""
    return collect(json.loads(Path(sweep_json).read_text()), Path(sweep_json).parents[2])
