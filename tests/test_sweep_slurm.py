"""A sweep on the session's SLURM cluster (cn07, cn08; training partition ``train``), with
``max_parallel`` and pruning: ``snakemake --profile profiles/slurm sweep`` of the digits task.

One good learning rate and two that cannot learn, ``max_parallel: 2`` of them at once while
the cluster has room for four one-CPU jobs: squeue never shows more than two training jobs.
The sweep's journal holds one trial finished before (as its training records it, with known
accuracies), so which trial is pruned does not hang on which job SLURM ends first: each
hopeless trial is below the median at epoch 1 and is pruned there (its job ends), the good one
is above it at every epoch and completes.
"""

from __future__ import annotations

import csv
import json
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from ddppipe.reports import summary
from ddppipe.spec import layout
from ddppipe.spec.run import Pruning, Trial
from ddppipe.training import pruning
from tests.slurm_cluster import SlurmCluster
from tests.slurm_fixtures import SlurmSlot
from tests.test_slurm import _finish, _start_snakemake, on_cluster, train_job_ids
from tests.tiny import default_config

pytestmark = pytest.mark.slurm

SWEEP, GOOD, BAD = "lr", 0.05, (1e-5, 2e-5)
EPOCHS, MAX_PARALLEL = 3, 2
FINISHED = {1: 0.5, 2: 0.6, 3: 0.7}  # a trial finished before: its accuracy at each epoch


def sweep_config(cluster: SlurmCluster, lrs: list[float]) -> dict[str, Any]:
    """The digits task, 3 short epochs on one CPU of one node; a grid of learning rates."""
    cfg = default_config()
    cfg.update(task="ddppipe.tasks.digits", task_args={"width": 8})
    cfg["train"].update(epochs=EPOCHS, batch_size=64)
    cfg["sweep"] = {"name": SWEEP, "parameters": {"train.lr": lrs}, "prune": "median",
                    "max_parallel": MAX_PARALLEL}  # fmt: skip
    return on_cluster(cfg, cluster, nodes=1, procs=1)


@dataclass
class Queue:
    """The workdir's jobs in squeue, polled while a snakemake call runs (every job of a sweep
    on the SLURM profile is a training: every other rule runs on the submitting machine)."""

    cluster: SlurmCluster
    workdir: Path
    most: int = 0  # the most jobs queued or running at once
    seen: set[str] = field(default_factory=set)
    _done: threading.Event = field(default_factory=threading.Event)

    def poll(self) -> None:
        while not self._done.is_set():
            lines = self.cluster.run("squeue -h -o '%i|%T|%Z'", check=False).stdout.splitlines()
            jobs = [job for job, _state, jobdir in (line.split("|") for line in lines)
                    if Path(jobdir).resolve() == self.workdir.resolve()]  # fmt: skip
            self.most = max(self.most, len(jobs))
            self.seen.update(jobs)
            time.sleep(0.3)

    def call(self, cfg: dict[str, Any]) -> tuple[str, int]:
        """``snakemake --profile profiles/slurm sweep``, squeue polled: (output, exit code)."""
        proc, out = _start_snakemake(self.cluster, self.workdir, cfg, "sweep")
        self._done.clear()
        poller = threading.Thread(target=self.poll, daemon=True)
        poller.start()
        try:
            text = _finish(proc, out, timeout=240)
        finally:
            self._done.set()
            poller.join()
        return text, proc.returncode


@pytest.fixture(scope="module")
def sweep(slurm_slot: SlurmSlot, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """The sweep's one call, after a trial that finished before."""
    cluster = slurm_slot.cluster()
    workdir = tmp_path_factory.mktemp("sweep-slurm") / "wd"
    prune = Pruning(method="median", metric="accuracy", direction="maximize", warmup_epochs=1)
    finished = pruning.TrialPruner(
        Trial(SWEEP, "lr=0.001", {"train.lr": 0.001}, prune),
        workdir / layout.SweepLayout(SWEEP).journal,
    )  # fmt: skip
    for epoch, accuracy in FINISHED.items():
        finished.report({"epoch": epoch, "test_accuracy": accuracy}, decide=False)
    finished.finish({"epoch": EPOCHS, "test_accuracy": FINISHED[EPOCHS]}, pruned=False)
    started = time.monotonic()
    queue = Queue(cluster, workdir)
    text, rc = queue.call(sweep_config(cluster, [GOOD, *BAD]))
    assert rc == 0, text[-6000:]
    print(f"(sweep on SLURM) snakemake {time.monotonic() - started:.0f}s")
    yield {"workdir": workdir, "queue": queue, "text": text}


def trial_dir(workdir: Path, lr: float) -> Path:
    return workdir / "results" / "sweeps" / SWEEP / f"lr={lr!r}"


def evaluation(workdir: Path, lr: float) -> dict[str, Any]:
    return json.loads((trial_dir(workdir, lr) / "eval" / "metrics.json").read_text())


def test_no_more_than_max_parallel_training_jobs_at_once(sweep: dict) -> None:
    queue = sweep["queue"]
    assert queue.most == MAX_PARALLEL, (queue.most, queue.seen)
    jobs = train_job_ids(subprocess.CompletedProcess([], 0, "", sweep["text"]))
    assert len(jobs) == 1 + len(BAD) == len(queue.seen), (jobs, queue.seen)


def test_hopeless_trials_are_pruned_at_epoch_1_and_the_good_one_completes(sweep: dict) -> None:
    wd = sweep["workdir"]
    good = evaluation(wd, GOOD)
    assert "pruned_at_epoch" not in good and good["epochs"] == EPOCHS
    metrics = trial_dir(wd, GOOD) / "train" / "metrics.jsonl"
    history = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert all(r["test_accuracy"] > FINISHED[r["epoch"]] for r in history), history
    for lr in BAD:
        found = evaluation(wd, lr)
        assert found["pruned_at_epoch"] == 1 and found["epochs"] == 1, (lr, found)
        assert found["test_accuracy"] < FINISHED[1], found
        ckpts = sorted(p.name for p in (trial_dir(wd, lr) / "state" / "checkpoints").iterdir())
        assert ckpts == ["ckpt-e0001-s000000.pt"], (lr, ckpts)
        assert (trial_dir(wd, lr) / "export" / "model.pt").is_file()
        text = summary.text(trial_dir(wd, lr))
        assert "pruned at epoch 1 (median rule of sweep lr on accuracy)" in text, text
    # the top trials printed at the end of the call
    assert sweep["text"].count("pruned at epoch 1") >= len(BAD), sweep["text"][-6000:]


def test_the_table_lists_each_trial_with_its_outcome(sweep: dict) -> None:
    wd = sweep["workdir"]
    with (wd / "results" / "sweeps" / SWEEP / "trials.csv").open() as f:
        rows = {row["trial"]: row for row in csv.DictReader(f)}
    assert {name: row["outcome"] for name, row in rows.items()} == {
        f"lr={GOOD!r}": "completed", **{f"lr={lr!r}": "pruned at epoch 1" for lr in BAD}
    }  # fmt: skip
    for lr in (GOOD, *BAD):
        row = rows[f"lr={lr!r}"]
        assert float(row["train.lr"]) == lr
        accuracy = evaluation(wd, lr)["test_accuracy"]
        assert float(row["accuracy"]) == pytest.approx(accuracy, abs=1e-6)  # 6 digits
    best = json.loads((wd / "results" / "sweeps" / SWEEP / "best.json").read_text())
    assert best["trials"] == {"completed": 1, "pruned": len(BAD), "failed": 0, "running": 0,
                              "pending": 0}  # fmt: skip
    assert best["best"]["trial"] == f"lr={GOOD!r}", best
