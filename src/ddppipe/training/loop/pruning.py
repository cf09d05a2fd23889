"""A sweep's trial pruning itself at epoch ends: Optuna's median rule or successive halving.

Every trial of a sweep reads and writes one Optuna study, named after the sweep, in the
sweep's journal file (``results/sweeps/<sweep>/optuna.journal``: a file, no database server;
Optuna's symlink lock serialises the trials' writes, also on a shared filesystem, and a lock
left by a killed process is broken after 30 s). A trial is one Optuna trial, found again by
its name (user attribute ``ddppipe_trial``) when its run resumes in a later slot or a retry,
or when a ``tpe`` round asked the study for it (:mod:`ddppipe.sweeps.rounds`); it reports its
metric at each epoch end (step = the epoch, from 1) and asks the pruner whether to stop there.
Only rank 0 of the training talks to Optuna (:func:`agreed` gives every rank its
decision); Optuna is imported only where a trial prunes.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ddppipe.settings import layout, run_spec
from ddppipe.settings.sweep import OPTUNA_TRIAL_ATTR
from ddppipe.settings.trial_names import current_name

log = logging.getLogger(__name__)

# Successive halving keeps the best half of the trials at each rung (min_resource epochs, then
# twice as many, ...): "halving"; Optuna's default of 4 keeps a quarter.
HALVING_FACTOR = 2
# The key of a pruned trial's train/evaluation.json (and eval/metrics.json): the epoch it
# stopped at.
PRUNED_AT = "pruned_at_epoch"


class PruningError(RuntimeError):
    """The trial cannot report its metric (unknown key) or reach its sweep's study."""


def history_key(metric: str) -> str:
    """The key of a metrics record (``train/metrics.jsonl``) that holds the sweep's metric:
    ``accuracy`` -> ``test_accuracy``, ``loss`` -> ``test_loss``, a task's own ``m`` ->
    ``test_m``."""
    return f"test_{metric}"


def metric_value(record: Mapping[str, Any], metric: str) -> float:
    """The sweep's ``metric`` in one epoch's record; PruningError naming the keys there are."""
    key = history_key(metric)
    if key not in record:
        tested = sorted(k.removeprefix("test_") for k in record if k.startswith("test_"))
        raise PruningError(
            f"sweep.metric {metric!r}: the evaluation has no {key}; it has "
            f"{', '.join(tested) or 'no test metric'} (accuracy and loss, and the keys of the "
            "task's metrics()): set sweep.metric to one of them"
        )
    return float(record[key])


def make_pruner(prune: run_spec.Pruning) -> Any:
    """The Optuna pruner of ``prune.method``: a trial trains at least ``warmup_epochs`` epochs
    (and one) before a decision."""
    import optuna

    if prune.method == "median":
        # One finished trial is enough to compare with: sweeps here have a few trials.
        return optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=prune.warmup_epochs)
    if prune.method == "halving":
        return optuna.pruners.SuccessiveHalvingPruner(
            min_resource=max(1, prune.warmup_epochs), reduction_factor=HALVING_FACTOR
        )
    raise ValueError(f"trial.prune.method {prune.method!r}: median or halving")


def open_study(journal: Path, sweep: str, prune: run_spec.Pruning) -> Any:
    """The sweep's study in ``journal`` (created by the first trial that gets here)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    journal.parent.mkdir(parents=True, exist_ok=True)
    storage = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(journal))
    )
    return optuna.create_study(
        storage=storage, study_name=sweep, direction=prune.direction,
        pruner=make_pruner(prune), load_if_exists=True,
    )  # fmt: skip


class TrialPruner:
    """(Rank 0) A sweep trial's Optuna trial: its reports, the pruner's decisions, its end."""

    def __init__(self, trial: run_spec.TrialSection, journal: Path | None = None) -> None:
        if trial.prune is None:
            raise ValueError(f"trial {trial.name}: pruning is off")
        self.trial, self.prune = trial, trial.prune
        self.journal = journal or layout.SweepLayout(trial.sweep).journal
        self._study: Any = None
        self._optuna_trial: Any = None
        self._reported: set[int] = set()  # steps (epochs) the Optuna trial has a value for

    @property
    def study(self) -> Any:
        if self._study is None:
            try:
                self._study = open_study(self.journal, self.trial.sweep, self.prune)
            except OSError as e:
                raise PruningError(
                    f"sweep {self.trial.sweep}: cannot open its Optuna journal {self.journal}: "
                    f"{e}; the trials' pruning needs it readable and writable"
                ) from e
        return self._study

    def _trial(self, create: bool = True) -> Any:
        """The trial's Optuna trial: the one its run left RUNNING (a resumed slot, a retry),
        else a new one (None without ``create``)."""
        if self._optuna_trial is not None:
            return self._optuna_trial
        import optuna

        study = self.study
        running = [
            t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
            if self._mine(t)
        ]  # fmt: skip
        if running:
            frozen = running[-1]
            self._optuna_trial = optuna.Trial(study, frozen._trial_id)
            self._reported = set(frozen.intermediate_values)
        elif create:
            self._optuna_trial = study.ask()
            self._optuna_trial.set_user_attr(OPTUNA_TRIAL_ATTR, self.trial.name)
            self._optuna_trial.set_user_attr("values", dict(self.trial.values))
        return self._optuna_trial

    def _told(self, optuna: Any) -> bool:
        """Whether the study holds this trial finished already (and no report of this slot)."""
        if self._optuna_trial is not None:
            return False
        done = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
        return any(self._mine(t) for t in self.study.get_trials(deepcopy=False, states=done))

    def _mine(self, frozen: Any) -> bool:
        """Whether the study's trial ``frozen`` is this trial's (its name as written now)."""
        return current_name(frozen.user_attrs.get(OPTUNA_TRIAL_ATTR, "")) == self.trial.name

    def report(self, record: Mapping[str, Any], decide: bool = True) -> bool:
        """Report the epoch ``record["epoch"]``'s metric; whether the trial should stop here
        (asked only with ``decide``: not after the last epoch)."""
        value = metric_value(record, self.prune.metric)
        trial, epoch = self._trial(), int(record["epoch"])
        if epoch not in self._reported:  # a slot that trained the epoch again: its first value
            trial.report(value, epoch)
            self._reported.add(epoch)
        if not decide:
            return False
        pruned = bool(trial.should_prune())
        if pruned:
            log.info("pruned at epoch %d: %s %.4g (%s rule of sweep %s)", epoch,
                     self.prune.metric, value, self.prune.method, self.trial.sweep)  # fmt: skip
        return pruned

    def finish(self, record: Mapping[str, Any], pruned: bool) -> None:
        """Tell the study how the trial ended: PRUNED, or COMPLETE with the final metric."""
        import optuna

        # A run resumed after its last checkpoint reports nothing: its trial was told already
        # unless the slot that trained it ended before (then it is still RUNNING).
        trial = self._trial(create=not self._told(optuna))
        if trial is None:
            return
        if pruned:
            self.study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            return
        value = metric_value(record, self.prune.metric)
        if math.isfinite(value):
            self.study.tell(trial, value)
        else:
            self.study.tell(trial, state=optuna.trial.TrialState.FAIL)


class RecordedPruning:
    """(Rank 0) A reproduction of a pruned trial: it stops where the trial's record says it
    was pruned (``trial.prune.at_epoch``), the sweep's study neither asked nor told."""

    def __init__(self, at_epoch: int) -> None:
        self.at_epoch = at_epoch

    def report(self, record: Mapping[str, Any], decide: bool = True) -> bool:
        pruned = decide and int(record["epoch"]) == self.at_epoch
        if pruned:
            log.info("pruned at epoch %d, as the reproduced trial was", self.at_epoch)
        return pruned

    def finish(self, record: Mapping[str, Any], pruned: bool) -> None:
        """Nothing to tell: the reproduction is no trial of the sweep's study."""


def of_trial(trial: run_spec.TrialSection) -> TrialPruner | RecordedPruning:
    """The pruner of a trial that prunes: the sweep's study, or the epoch its reproduction
    stops at."""
    if trial.prune is not None and trial.prune.at_epoch is not None:
        return RecordedPruning(trial.prune.at_epoch)
    return TrialPruner(trial)


def agreed(
    pruner: TrialPruner | RecordedPruning | None, record: Mapping[str, Any], decide: bool
) -> bool:
    """Collective: rank 0 (the one with a ``pruner``) reports the epoch's metrics ``record``
    to the sweep's study and, with ``decide``, asks whether to stop here; every rank gets its
    answer (or raises PruningError with rank 0's message)."""
    import torch.distributed as dist

    answer: list[Any] = [False]
    if pruner is not None:
        try:
            answer[0] = pruner.report(record, decide)
        except Exception as e:  # the others must not wait for a decision that never comes
            answer[0] = f"{type(e).__name__}: {e}"
    dist.broadcast_object_list(answer, src=0)
    if isinstance(answer[0], str):
        raise PruningError(f"rank 0 could not report to the sweep's study: {answer[0]}")
    return bool(answer[0])
