"""Experiment tracking that continues across requeues: TensorBoard, MLflow, W&B, each optional.

A run is trained in several job slots (SLURM requeues, preemptions, restarts), each a new
process that resumes from the last checkpoint at some global step S. Points the previous slot
logged at steps >= S were computed after that checkpoint and are recomputed now, so they are
stale. :class:`Tracker` (rank 0 only) keeps one continuous history over any number of slots by
fanning each point out to the backends: TensorBoard
(:mod:`ddppipe.training.tracking.tensorboard_log`, which purges the stale points), MLflow
(:mod:`ddppipe.training.tracking.mlflow_log`, which keeps them next to the new ones; a sweep's
trials are child runs of one parent run) and Weights & Biases
(:mod:`ddppipe.training.tracking.wandb_log`, which holds each point back until the checkpoint
covering its step commits, so no stale point reaches it; a sweep's trials are one group). The
trainer says when a checkpoint commits (:meth:`Tracker.checkpointed`) and adds the run's summary
and final weights (:meth:`Tracker.summary`, :meth:`Tracker.model`); TensorBoard and MLflow
ignore them.

Tracking never stops training: the first error of a backend is logged as a warning and that
backend is then off for the rest of the process. ``tensorboard``, ``mlflow`` and ``wandb`` are
imported on first use only.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from ddppipe.core import errors, system
from ddppipe.runstate.state import StateDir
from ddppipe.settings.run_spec import RunSpec
from ddppipe.training.tracking import mlflow_log, tensorboard_log, wandb_log

log = logging.getLogger(__name__)


class Tracker:
    """Scalars of one run, continued across job slots (construct and call on rank 0 only)."""

    def __init__(
        self,
        log_dir: Path | None,
        state: StateDir,
        *,
        mlflow_uri: str | None = None,
        run_name: str = "run",
        params: dict[str, Any] | None = None,
        tags: dict[str, str] | None = None,
        parent: mlflow_log.SweepParent | None = None,
        wandb: Mapping[str, Any] | None = None,
        group: str | None = None,
    ) -> None:
        """Track into TensorBoard files in ``log_dir`` (None: no TensorBoard), with
        ``mlflow_uri`` into MLflow and with ``wandb`` (``tracking.wandb``) into W&B.

        ``state`` is the run's state folder (it holds the MLflow run id). ``params`` are
        logged to MLflow once, when the run is created (nested dicts become dotted keys);
        ``tags`` are set by every slot. ``parent``: a trial's sweep (its MLflow run a child
        of the sweep's parent run). ``group``: a trial's sweep, its W&B group (W&B's config:
        ``params``; ``tags`` in its summary).
        """
        self.state = state
        self._tensorboard: tensorboard_log.TensorBoardLog | None = None
        if log_dir is not None:
            self._tensorboard = tensorboard_log.TensorBoardLog(Path(log_dir))
        self._tb_on = log_dir is not None
        self._closed = False
        self._bad_keys: set[str] = set()
        self._mlflow: mlflow_log.MlflowWorker | None = None
        if mlflow_uri is not None:
            self._mlflow = mlflow_log.MlflowWorker(
                mlflow_uri, self.state, run_name, dict(params or {}), dict(tags or {}), parent
            )
            self._mlflow.start()
        self._wandb: wandb_log.WandbLog | None = None
        if wandb is not None:
            self._wandb = wandb_log.WandbLog(wandb, state, run_name, dict(params or {}),
                                             group, dict(tags or {}))  # fmt: skip

    def open(self, step: int) -> None:
        """Before a slot trains from global ``step`` (its checkpoint's): TensorBoard's writer
        opened, forgetting earlier slots' points after that step (they are logged again)."""
        if self._tensorboard is not None and self._tb_on and not self._closed:
            try:
                self._tensorboard.open(step + 1)
            except Exception as e:
                self._tb_on = False
                log.warning("TensorBoard tracking off for this process: %s", errors.one_line(e))

    def log(self, step: int, values: Mapping[str, float], prefix: str = "") -> None:
        """Scalars at global ``step`` (keys like 'train/loss', 'test/accuracy', 'lr').

        With ``prefix``, key ``k`` is logged as ``prefix/k``. A slot's first call sets the step
        from which TensorBoard forgets the points of earlier slots: the first step logged after
        a resume must be the first step the previous slot logged after that checkpoint.
        """
        if self._closed:
            return
        points = dict(self._points(values, prefix))
        if not points:
            return
        if self._tensorboard is not None and self._tb_on:
            try:
                self._tensorboard.log(int(step), points, prefix)
            except Exception as e:
                self._tb_on = False
                log.warning("TensorBoard tracking off for this process: %s", errors.one_line(e))
        if self._mlflow is not None:
            self._mlflow.put(int(step), points)
        if self._wandb is not None:
            self._wandb.put(int(step), points)

    def checkpointed(self, step: int) -> None:
        """A checkpoint at global ``step`` is committed: W&B gets the points up to it."""
        if self._wandb is not None and not self._closed:
            self._wandb.checkpointed(int(step))

    @property
    def summarises(self) -> bool:
        """Whether a backend takes :meth:`summary` and :meth:`model` (W&B, still open)."""
        return self._wandb is not None and not self._closed

    def summary(self, values: Mapping[str, Any]) -> None:
        """Values for W&B's run summary (the outcome, provenance, efficiency)."""
        if self._wandb is not None and not self._closed:
            self._wandb.summary(values)

    def model(self, path: Path) -> None:
        """The final weights, for W&B as a reference artifact."""
        if self._wandb is not None and not self._closed:
            self._wandb.model(path)

    def close(self) -> None:
        """Write out everything logged (MLflow: waiting at most MLFLOW_CLOSE_TIMEOUT_S)."""
        if self._closed:
            return
        self._closed = True
        if self._tensorboard is not None:
            try:
                self._tensorboard.close()
            except Exception as e:
                log.warning("TensorBoard tracking off for this process: %s", errors.one_line(e))
        if self._mlflow is not None:
            self._mlflow.finish(mlflow_log.MLFLOW_CLOSE_TIMEOUT_S)
        if self._wandb is not None:
            self._wandb.finish()

    def _points(self, values: Mapping[str, float], prefix: str) -> Iterator[tuple[str, float]]:
        for key, value in values.items():
            tag = f"{prefix}/{key}" if prefix else key
            try:
                yield tag, float(value)
            except (TypeError, ValueError):
                if tag not in self._bad_keys:
                    self._bad_keys.add(tag)
                    log.warning("tracking skips %r: %r is not a number", tag, value)


def of_run(spec: RunSpec, state: StateDir, config_hash: str) -> Tracker | None:
    """(Rank 0) The tracking ``spec.tracking`` asks for, continued across every slot (None:
    no backend), tagged with the code, the task, the config hash and the SLURM job."""
    wanted = spec.tracking
    if not wanted.tensorboard and not wanted.mlflow and not wanted.wandb:
        return None
    source = spec.task_source or {}  # null where no launcher resolved the task
    tags = {"git_commit": str(system.git_commit()["commit"]),
            "task": str(source.get("ref")), "task_sha256": str(source.get("sha256")),
            "config_hash": config_hash}  # fmt: skip
    if os.environ.get("SLURM_JOB_ID"):
        tags[f"slurm_job_{os.environ['SLURM_JOB_ID']}"] = socket.gethostname()
    return Tracker(
        state.tensorboard if wanted.tensorboard else None, state, mlflow_uri=wanted.mlflow,
        run_name=spec.run, params=spec.as_dict(),  # MLflow's params: the config as written
        tags=tags, parent=mlflow_log.SweepParent.of(spec, state),  # a trial: a child run
        wandb=wanted.wandb, group=spec.trial.sweep if spec.trial else None,
    )  # fmt: skip
