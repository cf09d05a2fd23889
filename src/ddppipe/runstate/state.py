"""The files in a run's state folder (``results/<run>/state``, whose root
:class:`ddppipe.settings.layout.RunLayout` gives): the one place that knows them.

The folder survives failed, preempted and requeued jobs (it is no Snakemake output), so it
holds everything a later slot needs: checkpoints, the attempt history, rank 0's progress, the
stop note, the nodes that finished the last step, the nodes excluded after their own checks
failed, the lock, the live log and metrics, the MLflow run id, and a script's outputs.

The folder travels through ddppipe as a :class:`StateDir`; a path becomes one once, where it
enters: the ``--state`` argument, the slot record, the workflow's rules, a run's
layout read back (:mod:`ddppipe.reports.run_files`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ddppipe.settings import layout


@dataclass(frozen=True)
class StateDir:
    """A run's state folder: ``root`` and the files in it."""

    root: Path

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def attempts(self) -> Path:
        return self.root / "attempts.json"

    @property
    def progress(self) -> Path:
        return self.root / "progress.json"

    @property
    def stop_note(self) -> Path:
        return self.root / "stopped-on-signal.json"

    @property
    def slot(self) -> Path:
        """The current slot's record, written by its launcher for every process
        (ddppipe.core.slot)."""
        return self.root / "slot.json"

    @property
    def slot_ended(self) -> Path:
        """Touched when a slot's launcher ends: wakes the submitting Snakemake's status checks
        (ddppipe.slurm.executor.status_checks)."""
        return self.root / "slot-ended"

    @property
    def finished_nodes(self) -> Path:
        """One file a node whose agent saw its ranks finish this slot
        (ddppipe.runstate.finished_nodes)."""
        return self.root / "finished-nodes"

    @property
    def node_beats(self) -> Path:
        """One record a node, its agent's report of its ranks while its step runs
        (ddppipe.runstate.node_beats): the hang watchdog's reading, and a node gone silent is
        a lost node."""
        return self.root / "node-beats"

    @property
    def watchdog(self) -> Path:
        """The current slot's stack dumps (one a rank, copied there by its node's agent when
        the watchdog asked for them) and NCCL flight records
        (ddppipe.training.measuring.heartbeat, ddppipe.launching.watchdog)."""
        return self.root / "watchdog"

    @property
    def hangs(self) -> Path:
        """Every rank's stack of each slot that hung, one file a slot (``attempt-N.txt``)."""
        return self.root / "hangs"

    @property
    def failures(self) -> Path:
        """The current slot's failed ranks: one record each, with its exception and the frame
        of the user's file it came from (ddppipe.runstate.failures)."""
        return self.root / "failures"

    @property
    def final_failure(self) -> Path:
        """The failure that ended the run for good (a non-finite loss, the same crash twice):
        later slots of the same config refuse to train (ddppipe.runstate.failures)."""
        return self.root / "final-failure.json"

    @property
    def early_failures(self) -> Path:
        """The run's jobs that failed before the launcher started, with the errors their logs
        name (ddppipe.runstate.prelaunch_failures)."""
        return self.root / "early-failures.json"

    @property
    def excluded_nodes(self) -> Path:
        """The run's bad-node record: the nodes that failed their own checks, excluded from the
        run's next slots, in order (ddppipe.slurm.bad_nodes)."""
        return self.root / "excluded-nodes.json"

    @property
    def lock(self) -> Path:
        return self.root / ".lock"

    @property
    def log(self) -> Path:
        return self.root / "train.log"

    @property
    def metrics(self) -> Path:
        """Live metrics (JSON lines) of the training so far: per epoch, or per job.log call."""
        return self.root / "metrics.jsonl"

    @property
    def mlflow_run_id(self) -> Path:
        return self.root / "mlflow_run_id"

    @property
    def wandb_run_id(self) -> Path:
        """The run's W&B run id, minted by its first slot
        (:mod:`ddppipe.training.tracking.wandb_log`)."""
        return self.root / "wandb_run_id"

    @property
    def wandb(self) -> Path:
        """W&B's folder of every slot (``wandb/`` next to the state folder, for users)."""
        return layout.RunLayout.of_root(self.root.parent).wandb

    @property
    def outputs(self) -> Path:
        """A script's output files (job.output_dir()), published when training completes."""
        return self.root / "outputs"

    @property
    def tensorboard(self) -> Path:
        """TensorBoard event files of every slot (next to the state folder, for users)."""
        return layout.RunLayout.of_root(self.root.parent).tensorboard
