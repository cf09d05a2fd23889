"""Every run a config defines: the base run, the scaling study's runs and the sweep's trials.

The workflow builds one :class:`Runs` when it is parsed and asks it for the config of each
``{run}`` its rules meet; a name it does not define is an error, so a typo never trains a
mislabeled run.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from ddppipe.settings import run_spec, scaling
from ddppipe.settings import sweep as sweeps
from ddppipe.settings.config import ConfigError


class Runs:
    """The runs of one config, each with its config and, resolved once, its spec.

    ``decide``: whether a run's config trains on GPUs, the one device decision
    (:func:`ddppipe.parallel.devices.trains_on_gpus`, where the runs are submitted); without it
    the runs have configs but no specs. ``trials``: a sweep's trials known now; the workflow
    passes :func:`ddppipe.runstate.sweep_rounds.trials`, which reads a model-based sweep's
    rounds (without it, such a sweep has no trials).
    """

    def __init__(
        self,
        cfg: dict[str, Any],
        decide: Callable[[dict[str, Any]], bool] | None = None,
        trials: Callable[[sweeps.Sweep], list[sweeps.Trial]] = sweeps.trials,
    ) -> None:
        self._decide = decide
        self._read_trials = trials
        self._specs: dict[str, run_spec.RunSpec] = {}
        self.base = cfg
        self.sweep = sweeps.from_config(cfg)
        self.scaling = scaling.study(cfg)  # the scaling study: a grid sweep of its own
        self._scaling = {t.run: t for t in sweeps.trials(self.scaling)}
        self._trials: dict[str, sweeps.Trial] = {}
        self._places: dict[str, int] = {}
        self.refresh()

    def refresh(self) -> None:
        """Read the sweep's trials again (a model-based method's rounds add trials)."""
        if self.sweep is not None:
            self._trials = {t.run: t for t in self._read_trials(self.sweep)}
            self._places = {run: i for i, run in enumerate(self._trials)}

    @property
    def trials(self) -> list[sweeps.Trial]:
        """The sweep's trials known now (none without a sweep)."""
        return list(self._trials.values())

    def place(self, run: str) -> int | None:
        """The place of the trial ``run`` in the sweep (0: the first; a grid's in the order of
        its values, random draws and suggestions in theirs); None for a run that is no trial."""
        return self._places.get(run)

    def scaling_runs(self) -> list[str]:
        """The scaling study's trials (``sweeps/scaling/<trial>``)."""
        return list(self._scaling)

    def names(self) -> list[str]:
        """Every run: the base run, the scaling study's, the sweep's known trials."""
        return [self.base["run"], *self.scaling_runs(), *self._trials]

    def spec(self, run: str) -> run_spec.RunSpec:
        """The spec of run ``run``: its config resolved once, with its device decided; every
        use in this process (the SLURM request, threads, the image, write_config) reads it."""
        if run not in self._specs:
            if self._decide is None:
                raise ConfigError("these runs were made without a device decision: no spec")
            cfg = self.config(run)
            self._specs[run] = run_spec.resolve(cfg, self._decide(cfg))
        return self._specs[run]

    def config(self, run: str) -> dict[str, Any]:
        """The config of run ``run`` (a copy); raise ConfigError for a name it does not define."""
        if run == self.base["run"]:
            out = copy.deepcopy(self.base)
            out.pop("scaling", None)  # a run that is no trial: its config names no study
            out.pop("sweep", None)
            return out
        if run in self._scaling:
            return scaling.apply(self.base, self.scaling, self._scaling[run])
        if run not in self._trials and self.sweep is not None and self.sweep.method == "tpe":
            self.refresh()  # a round suggested since
        trial = self._trials.get(run)
        if trial is None or self.sweep is None:
            known = ", ".join(self.names()[:5]) + (", ..." if len(self.names()) > 5 else "")
            raise ConfigError(f"unknown run {run!r}: this config defines the runs {known}")
        return sweeps.apply(self.base, self.sweep, trial)  # a copy
