"""Every change ddppipe makes to Snakemake's own objects, installed by one function.

The workflow's ``onstart`` calls :func:`install` once. It checks the Snakemake version first
(:data:`TESTED`: the versions each change below was written and tested against), then makes
each change the call needs:

- the SLURM executor's extension (:mod:`ddppipe.slurm.executor`, which checks its plugin's
  version itself): on a SLURM call;
- the local scheduler's selector lends a core to the zero-thread rules
  (:mod:`ddppipe.pipeline.beside`): always;
- the scheduler's re-evaluation timer no longer holds the call's exit
  (:mod:`ddppipe.pipeline.prompt_exit`): always;
- a sweep's trials start in their order (:mod:`ddppipe.pipeline.in_order`) and a failed trial
  does not stop the others (the scheduler's ``keepgoing``): with a sweep.

Nothing else in ddppipe changes a Snakemake object.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ddppipe.core.errors import UserError
from ddppipe.pipeline import beside, in_order, prompt_exit
from ddppipe.runstate import state as run_state
from ddppipe.slurm import executor

TESTED = ((9, 0), (10, 0))  # major, minor: from (included) to (excluded)


class SnakemakeVersionError(RuntimeError, UserError):
    """The running Snakemake is not a version ddppipe's changes were written for."""


def check_version(found: str) -> None:
    """Raise SnakemakeVersionError unless Snakemake ``found`` is in :data:`TESTED`."""
    low, high = TESTED
    if not low <= _major_minor(found) < high:
        raise SnakemakeVersionError(
            "ddppipe changes Snakemake's scheduler (the rules beside a training, the sweep's "
            "trials in order, --keep-going for a sweep: ddppipe.pipeline.snakemake_changes) "
            f"as Snakemake >={_text(low)},<{_text(high)} has it, and Snakemake {found} runs "
            "this workflow: install a Snakemake of that range (`make env` installs the one "
            f"pyproject.toml pins), or check each change against {found} and widen "
            "ddppipe.pipeline.snakemake_changes.TESTED"
        )


def _major_minor(version: str) -> tuple[int, int]:
    major, minor, *_ = [*re.findall(r"\d+", version), "0", "0"]
    return int(major), int(minor)


def _text(version: tuple[int, int]) -> str:
    return ".".join(map(str, version))


@dataclass(frozen=True)
class Changes:
    """What one snakemake call needs changed.

    ``on_slurm``: the call submits to SLURM; ``training_state``: a train job's state folder
    (None for another job); ``run_states``: every run's state folder; ``trial_order``: with a
    sweep, a job's place in it (None: no sweep).
    """

    on_slurm: bool
    training_state: Callable[[Any], run_state.StateDir | None]
    run_states: Sequence[run_state.StateDir]
    trial_order: in_order.Order | None


def install(workflow: Any, changes: Changes, version: str | None = None) -> None:
    """Make ``changes`` to ``workflow``'s executor and scheduler (Snakemake ``version``, by
    default the running one). Raise SnakemakeVersionError or executor.PluginVersionError
    before changing anything."""
    if version is None:
        import snakemake

        version = snakemake.__version__
    check_version(version)
    from snakemake.scheduling.job_scheduler import JobScheduler

    if changes.on_slurm:
        extension = executor.Extension(changes.training_state, list(changes.run_states))
        extension.install(workflow.executor_plugin.executor)
    beside.install(JobScheduler)
    prompt_exit.install(JobScheduler)
    if changes.trial_order is not None:
        in_order.install(JobScheduler, changes.trial_order)
        if workflow.scheduler is not None:
            workflow.scheduler.keepgoing = True
