"""One snakemake call's start and end (the Snakefile's ``onstart``, ``onsuccess`` and
``onerror``): the cluster's settings checked, Snakemake changed, warm ranks, the summary."""

from __future__ import annotations

import gc
import os
from pathlib import Path

from snakemake.exceptions import WorkflowError
from snakemake.logging import logger

from ddppipe.apptainer import tool as apptainer
from ddppipe.core import env_names
from ddppipe.launching import warm
from ddppipe.pipeline import snakemake_changes
from ddppipe.pipeline.pipeline import Pipeline
from ddppipe.settings import layout
from ddppipe.slurm import cluster_policy, executor


def start(p: Pipeline) -> None:
    """Before the first job: on SLURM, the cluster's settings that would hang the workflow
    or lose work refused (or warned of: ddppipe.slurm.cluster_policy); Snakemake changed
    (ddppipe.pipeline.snakemake_changes, its version checked); warm ranks for a local call
    that trains."""
    try:
        if p.on_slurm():
            settings = p.workflow.executor_settings
            found = cluster_policy.check_cluster(p.runs.spec(p.run), settings.status_command,
                                                 settings.requeue, p.run_states())  # fmt: skip
            for finding in found:
                logger.warning(f"ddppipe cluster check: {finding}")
        order = p.sweep.order if p.sweep.sweep is not None else None
        changes = snakemake_changes.Changes(p.on_slurm(), p.training_state, p.run_states(),
                                            order)  # fmt: skip
        snakemake_changes.install(p.workflow, changes)
    except (cluster_policy.ClusterPolicyError, snakemake_changes.SnakemakeVersionError,
            executor.PluginVersionError) as e:  # fmt: skip
        raise WorkflowError(str(e)) from None  # shown as a message, without a traceback
    _start_warm_ranks(p)


def end(p: Pipeline) -> None:
    """After the last job (success or not): the warm server left to the next call (it ends
    when none comes: ddppipe.launching.warm.KEEP_S), a packed sweep's idle allocations ended,
    the run's summary and the sweep's table printed; the process's exit made quick."""
    os.environ.pop(env_names.WARM_SOCKET, None)
    os.environ.pop(env_names.WARM_SERVER, None)
    p.sweep.close_pack()
    from ddppipe.reports import summary

    root = layout.RunLayout(p.run).root
    if root.is_dir():
        logger.info(summary.text(root))
    if p.sweep.sweep is not None:  # its table and best trial written from what exists
        from ddppipe.sweeps import results

        logger.info(results.after_call(p.sweep.sweep, layout.RESULTS))
    # Snakemake's objects kept out of the interpreter's collections at its exit: they are freed
    # with the process, and the collections over them took 0.35-0.45 s of every call's end
    gc.freeze()


def _start_warm_ranks(p: Pipeline) -> None:
    """A local call that trains: one server imports torch once, while Snakemake starts the
    first jobs, and forks every rank of every run (ddppipe.launching.warm) and every ddppipe
    command of the rules that would import torch (the config's model check, evaluation, plots,
    export), instead of each importing it. Not on SLURM (the ranks run on the job's nodes), nor
    in a container (another Python), nor in a job's own snakemake, nor for a call that trains
    nothing (its rules import no torch)."""
    if p.on_slurm() or apptainer.enabled(p.runs.spec(p.run).container):
        return
    if os.environ.get("SLURM_JOB_ID") or not _trains(p):
        return
    socket, server = warm.kept(Path.cwd(), layout.LOGS / "warm-server.log", p.warm_datasets())
    os.environ[env_names.WARM_SOCKET] = str(socket)
    os.environ[env_names.WARM_SERVER] = str(server)


def _trains(p: Pipeline) -> bool:
    """Whether this call trains a run (or suggests trials still to train)."""
    todo = {j.rule.name for j in p.workflow.dag.needrun_jobs()}
    return bool(todo & {"train", "train_packed", "sweep_round"})
