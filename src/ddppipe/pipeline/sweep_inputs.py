"""A sweep in the workflow (``sweep:``, rules/sweep.smk): its rules' inputs, a trial's slot and
priority, and a packed sweep's trials (``sweep.pack``, rule train_packed)."""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable
from typing import Any

from snakemake.exceptions import WorkflowError

from ddppipe.launching import launch
from ddppipe.packing import allocation, pool
from ddppipe.pipeline import in_order
from ddppipe.runstate import sweep_rounds
from ddppipe.settings import config as configs
from ddppipe.settings import layout
from ddppipe.settings import sweep as sweeps
from ddppipe.settings.runs import Runs

SLOT = "ddppipe_sweep_trials"  # rule train's resource: a trial holds one of max_parallel


class SweepInputs:
    """The config's sweep (``runs.sweep``, None without one) as the rules see it; ``kind``:
    what its runs train; ``checkpoints``: the workflow's (a tpe round is a checkpoint);
    ``metric_source``: the task file whose metric the sweep ranks by (None: a script)."""

    def __init__(self, runs: Runs, kind: str, checkpoints: Any,
                 metric_source: str | None) -> None:  # fmt: skip
        self.runs, self.kind, self.checkpoints = runs, kind, checkpoints
        self.sweep = runs.sweep
        self.packed = self.sweep is not None and self.sweep.pack is not None
        prefix = re.escape(sweeps.run_name(self.sweep.name, "")) if self.packed else None
        self.packed_run = f"{prefix}[^/]+" if self.packed else ".+"  # (no slash in a trial)
        self.unpacked_run = f"(?!{prefix}).+" if self.packed else ".+"
        if self.sweep is None:
            return
        try:
            sweeps.check_definition(self.sweep)  # one name, one sweep: never two in one table
            sweeps.check_metric(self.sweep, metric_source)
            if self.packed and runs.trials:  # (a tpe sweep's first: when it is suggested)
                allocation.Allocation.of(runs.spec(runs.trials[0].run))
        except (configs.ConfigError, allocation.PackError) as e:
            raise WorkflowError(str(e)) from None

    def slots(self) -> int | None:
        """The trials that train at once (None: no sweep, no resource to register)."""
        return None if self.sweep is None else allocation.trials_at_once(self.sweep)

    def rounds_note(self) -> str | None:
        """A model-based sweep's note on its rounds, for the log."""
        tpe = self.sweep is not None and self.sweep.method == "tpe"
        return sweep_rounds.rounds_note(self.sweep) if tpe else None

    # -- rule train: a trial's slot, priority and place; a packed trial's command --------

    def place(self, run: str) -> int | None:
        """The place of the trial ``run`` (0: the first; a grid's values in their order, the
        first key varying slowest, random and tpe trials in the order drawn); None for a run
        that is no trial of the sweep."""
        return self.runs.place(run)

    def trial_slot(self, wildcards: Any) -> int:
        """1 for a sweep's trial (it holds one of max_parallel slots), 0 for another run."""
        trial = sweeps.run_name(self.sweep.name, "") if self.sweep is not None else None
        return int(trial is not None and wildcards.run.startswith(trial))

    def priority(self, wildcards: Any) -> int:
        """Rule train's priority: a trial's, the earlier in the sweep the higher (Snakemake
        starts the ready jobs of the highest first); 0 for any other run."""
        place = self.place(wildcards.run)
        if place is None:
            return 0
        return in_order.priority(place, max(len(self.runs.trials), self.sweep.trials))

    def order(self, job: Any) -> int | None:
        """A trial's training job: its place in the sweep; None for any other job."""
        if job.name not in ("train", "train_packed"):
            return None
        return self.place(job.wildcards_dict["run"])

    def packed_prefix(self, run: str, on_slurm: bool) -> str:
        """On SLURM, the command a packed trial's launch runs under: `ddppipe pack-trial` (it
        queues the launch for the sweep's allocations and waits); '' otherwise."""
        if not (self.packed and on_slurm and re.fullmatch(self.packed_run, run)):
            return ""
        return (
            f"ddppipe pack-trial --pool {shlex.quote(str(self.sweep.layout.pack))}"
            f" --config {shlex.quote(str(layout.RunLayout(run).config))}"
            f" --order {self.place(run)} -- "
        )

    def packed_threads(self, run: str, on_slurm: bool) -> int:
        """A packed trial's cores on this machine: none on SLURM (it waits), else its
        training's."""
        return 0 if on_slurm else launch.job_threads(self.runs.spec(run))

    def close_pack(self) -> None:
        """At the end of the call: the packed sweep's idle allocations end at once."""
        if self.packed:
            pool.Pool(self.sweep.layout.pack).close()

    # -- rules sweep, sweep_trials, sweep_table and sweep_round -------------------------

    def _layout(self) -> Any:
        if self.sweep is None:
            raise WorkflowError(
                "no sweep in this config: set sweep.name and sweep.parameters, e.g. --config "
                "'sweep={name: lr, parameters: {train.lr: [0.01, 0.1]}}' (docs/sweeps.md)"
            )
        return self.sweep.layout

    def _tpe(self) -> bool:
        return self.sweep is not None and self.sweep.method == "tpe"

    def trial_runs(self) -> list[str]:
        """The runs of the sweep's trials: a model-based sweep's once all its rounds are
        suggested (before that, the next round's checkpoint: Snakemake asks again once it
        has run)."""
        if self._tpe():
            return self.rounds_trial_runs(len(sweep_rounds.round_sizes(self.sweep)))
        return [t.run for t in self.runs.trials]

    def rounds_trial_runs(self, upto: int) -> list[str]:
        """The runs of the trials of a model-based sweep's rounds before round ``upto``; raise
        Snakemake's IncompleteCheckpointException for the first round not suggested yet."""
        for k in range(upto):
            self.checkpoints.sweep_round.get(sweep=self.sweep.name, round=str(k))
        self.runs.refresh()
        return [t.run for t in sweep_rounds.trials(self.sweep, upto=upto)]

    def targets(self, wildcards: Any) -> list[str]:
        """Rule sweep's input: the table, best trial and figures, and the outputs of every
        trial known now; while a model-based sweep has a round to suggest, that round's file
        too, so each trial trains (and is evaluated) as soon as its round is suggested, next
        to the trials before it, not once every round is."""
        sweep_layout = self._layout()
        k = sweep_rounds.unsuggested_round(self.sweep) if self._tpe() else None
        if k is None:
            runs, next_round = self.trial_runs(), []
        else:
            runs, next_round = self.rounds_trial_runs(k), [sweep_rounds.round_file(self.sweep, k)]
        targets = [t for run in runs for t in layout.RunLayout(run).targets(self.kind)]
        fixed = (sweep_layout.trials_csv, sweep_layout.best, sweep_layout.overview)
        return [str(p) for p in (*fixed, *next_round, *targets)]

    def finished_rounds(self, wildcards: Any) -> list[str]:
        """Round k's input: round k - 1's file (its job then waits inside for a free slot,
        ddppipe.sweeps.slots); a sweep suggested in whole rounds: every trial before it,
        evaluated."""
        k = int(wildcards.round)
        if sweep_rounds.whole_rounds(self.sweep):
            runs = self.rounds_trial_runs(k)
            return [str(layout.RunLayout(run).eval.metrics) for run in runs]
        return [str(sweep_rounds.round_file(self.sweep, k - 1))] if k else []

    def all_rounds(self, wildcards: Any) -> list[str]:
        """A model-based sweep's round files, once every round is suggested; none otherwise."""
        if not self._tpe():
            return []
        sizes = sweep_rounds.round_sizes(self.sweep)
        self.rounds_trial_runs(len(sizes))
        return [str(sweep_rounds.round_file(self.sweep, k)) for k in range(len(sizes))]

    def trial_files(self, path: Callable[[layout.RunLayout], Any]) -> Callable[[Any], list[str]]:
        """``path`` (a function of a trial's RunLayout) of every trial known now."""
        return lambda wildcards: [str(path(layout.RunLayout(r))) for r in self.trial_runs()]
