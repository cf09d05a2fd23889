"""Which prepared data each run trains on: one folder per distinct set of the values its
task's ``prepare()`` reads.

The base config's data is ``resources/<task>/`` (as it always was). A run whose values of the
``task_args`` that ``prepare()`` reads (the task's ``PREPARE_ARGS``, all of them where it
declares none: :mod:`ddppipe.tasks.prepare_args`) differ from the base config's trains on data
prepared for its own values, ``resources/<task>+<key>=<value>/`` (a sweep of
``task_args.test_fraction``: ``resources/digits+test_fraction=0.2/``), named like a trial. So
no run trains on data prepared for other values, and runs that differ only in what
``prepare()`` does not read share one preparation.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ddppipe.settings import trial_names


@dataclass(frozen=True)
class DataSets:
    """The prepared data of the runs of one task."""

    task: str  # the task's short name: the base config's data folder
    base: Mapping[str, Any] = field(default_factory=dict)  # the base config's task_args
    reads: tuple[str, ...] | None = None  # the task_args prepare() reads; None: all

    def _read(self, args: Mapping[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in args.items() if self.reads is None or k in self.reads}

    def _differing(self, task_args: Mapping[str, Any]) -> dict[str, Any]:
        own, base = self._read(task_args), self._read(self.base)
        return {f"task_args.{k}": own.get(k) for k in sorted(set(own) | set(base))
                if own.get(k) != base.get(k)}  # fmt: skip

    def name(self, task_args: Mapping[str, Any]) -> str:
        """The data folder's name (under ``resources/``) of a run with these ``task_args``."""
        differing = self._differing(task_args)
        if not differing:
            return self.task
        return f"{self.task}{trial_names.SEPARATOR}{trial_names.value_name(differing)}"

    def task_args(self, task_args: Mapping[str, Any]) -> dict[str, Any]:
        """What that folder is prepared with: the base config's ``task_args`` with the values
        ``prepare()`` reads of the run's (the same for every run sharing the folder)."""
        return {**copy.deepcopy(dict(self.base)), **copy.deepcopy(self._read(task_args))}
