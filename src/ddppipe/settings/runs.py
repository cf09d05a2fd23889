"""Every run a config defines: the base run, the scaling study's runs and the sweep's trials.

The workflow builds one :class:`Runs` when it is parsed and asks it for the config of each
``{run}`` its rules meet; a name it does not define is an error, so a typo never trains a
mislabeled run.
"""

from __future__ import annotations

import copy
from typing import Any

from ddppipe.settings import scaling
from ddppipe.settings import sweep as sweeps
from ddppipe.settings.config import ConfigError


class Runs:
    """The runs of one config, each with its config."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.base = cfg
        self.sweep = sweeps.from_config(cfg)
        self.scaling = scaling.study(cfg)  # the scaling study: a grid sweep of its own
        self._scaling = {t.run: t for t in sweeps.trials(self.scaling)}
        self._trials: dict[str, sweeps.Trial] = {}
        self.refresh()

    def refresh(self) -> None:
        """Read the sweep's trials again (a model-based method's rounds add trials)."""
        if self.sweep is not None:
            self._trials = {t.run: t for t in sweeps.trials(self.sweep)}

    @property
    def trials(self) -> list[sweeps.Trial]:
        """The sweep's trials known now (none without a sweep)."""
        return list(self._trials.values())

    def scaling_runs(self) -> list[str]:
        """The scaling study's trials (``sweeps/scaling/<trial>``)."""
        return list(self._scaling)

    def names(self) -> list[str]:
        """Every run: the base run, the scaling study's, the sweep's known trials."""
        return [self.base["run"], *self.scaling_runs(), *self._trials]

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
