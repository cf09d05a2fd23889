"""ddppipe's extension of the SLURM plugin's executor: one declaration, installed in one place.

snakemake-executor-plugin-slurm runs every training job; ddppipe changes five things of its
executor class, each in its own module:

- :mod:`~.failed_node_names`: submissions go on after a node failure (no ``--exclude`` of a
  placeholder);
- :mod:`~.status_checks`: a job's end is noticed within seconds of its slot's end;
- :mod:`~.exclusions`: a node that failed its own checks as a slot started (its record:
  :mod:`ddppipe.slurm.bad_nodes`) is excluded from its next slot;
- :mod:`~.attach`: a restarted snakemake waits for the run's live training job instead of
  submitting a second;
- :mod:`~.early_failures`: a job that fails before its launcher starts is named, and not
  retried twice.

They rely on the executor's interface of one plugin version (:data:`TESTED`; pyproject.toml
pins it): :func:`install` refuses any other version with a clear message before anything is
submitted, so an upgrade cannot break them one by one, silently.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ddppipe.core.errors import UserError
from ddppipe.runstate.state import StateDir
from ddppipe.slurm.executor import (
    attach,
    early_failures,
    exclusions,
    failed_node_names,
    status_checks,
)

PLUGIN = "snakemake-executor-plugin-slurm"
TESTED = "2.8.0"  # the plugin version whose executor the extensions were written against


class PluginVersionError(RuntimeError, UserError):
    """The installed SLURM plugin is not the version ddppipe's extensions were written for."""


def installed_version() -> str | None:
    try:
        return importlib.metadata.version(PLUGIN)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_version(found: str | None) -> None:
    """Raise PluginVersionError unless ``found`` is :data:`TESTED`."""
    if found != TESTED:
        raise PluginVersionError(
            f"ddppipe extends the SLURM executor of {PLUGIN} {TESTED} (failed node names, "
            "status checks, bad nodes, attaching to live jobs, early failures: "
            f"ddppipe.slurm.executor), and {found or 'no version'} is installed: install "
            f"{PLUGIN}=={TESTED} (as pyproject.toml pins it, `make env`), or check each "
            "extension against the new version and raise ddppipe.slurm.executor.TESTED"
        )


@dataclass(frozen=True)
class Extension:
    """ddppipe's changes to the SLURM executor of one snakemake call."""

    state_of: Callable[[Any], StateDir | None]  # a job's run state folder; None: not a training
    states: list[StateDir]  # the state folders of every run the call may train

    def install(self, executor: type, version: str | None = None) -> None:
        """Install every extension on ``executor`` (the plugin's class), after checking the
        plugin's ``version`` (default: the installed one). Raise PluginVersionError."""
        check_version(installed_version() if version is None else version)
        failed_node_names.install(executor)
        status_checks.install(executor, self.states)
        exclusions.install(executor, self.state_of)
        attach.install(executor)
        early_failures.install(executor, self.state_of)
