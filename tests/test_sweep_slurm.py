"""Sweeps on the session's SLURM cluster (cn07, cn08; training partition ``train``, not the
default), three ``snakemake --profile profiles/slurm`` calls side by side:

- ``sweep`` over two keys (trial names ``lr=0.05+batch_size=64``, which the plugin hands to the
  job's own Snakemake intact), with ``max_parallel`` and pruning, of the digits task. One good
  learning rate listed first and two that cannot learn (the grid of #41's report: Snakemake
  trained lr 1e-05 first, its config file the longest), ``max_parallel: 1`` while the cluster
  has room for four one-CPU jobs: squeue never shows more than one of its training jobs, and
  they train in the grid's order (the good one first, as listed; tests/test_sweep.py orders a
  6-trial grid locally: on SLURM each trial in turn costs its job's start, ~30 s). The sweep's
  journal holds one trial finished before (as its training records it, with known
  accuracies), so which trial is pruned does not hang on which job SLURM ends first: each
  hopeless trial is below the median at epoch 1 and is pruned there (its job ends), the good
  one is above it at every epoch and completes.
- ``scaling``, the scaling study (docs/training.md), on one node and on both.
- ``sweep`` of a task file that the nodes do not see (its folder hidden on them by a bind
  mount in their mount namespaces): every job fails in its own Snakemake before training;
  the failure is named in the table, the trial's summary and the call's last lines, and the
  second identical failure is not retried (2 jobs, not the profile's 1 + 2 retries).
"""

from __future__ import annotations

import contextlib
import csv
import json
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from ddppipe.reports import summary
from ddppipe.settings import layout
from ddppipe.settings.run_spec import Pruning, TrialSection
from ddppipe.training.loop import pruning
from tests.slurm_cluster import SlurmCluster
from tests.slurm_fixtures import SlurmSlot
from tests.test_slurm import _finish, _start_snakemake, logs, on_cluster, train_job_ids
from tests.tiny import REPO, default_config

pytestmark = pytest.mark.slurm

SWEEP, GOOD, BAD = "lr", 0.05, (1e-5, 2e-5)
EPOCHS, MAX_PARALLEL, BATCH = 3, 1, 64
FINISHED = {1: 0.5, 2: 0.6, 3: 0.7}  # a trial finished before: its accuracy at each epoch
HIDDEN_TASK = (
    "tasks/digits_copy.py"  # the early-failure sweep's task: its folder hidden on the nodes
)


def digits_config(cluster: SlurmCluster) -> dict[str, Any]:
    """The digits task, short epochs on one CPU of one node."""
    cfg = default_config()
    cfg.update(task="ddppipe.tasks.digits", task_args={"width": 8})
    cfg["train"].update(epochs=EPOCHS, batch_size=BATCH)
    return on_cluster(cfg, cluster, nodes=1, procs=1)


def sweep_config(cluster: SlurmCluster, lrs: list[float]) -> dict[str, Any]:
    """A grid of learning rates and one batch size (two keys)."""
    cfg = digits_config(cluster)
    cfg["sweep"] = {"name": SWEEP, "parameters": {"train.lr": lrs, "train.batch_size": [BATCH]},
                    "prune": "median", "max_parallel": MAX_PARALLEL}  # fmt: skip
    return cfg


def scaling_config(cluster: SlurmCluster) -> dict[str, Any]:
    """The scaling study of one epoch: one process on one node, and on both nodes."""
    cfg = digits_config(cluster)
    cfg["scaling"].update(nodes=[1, 2], procs_per_node=[1], cpus_per_proc=[1], epochs=1)
    return cfg


def hidden_task_config(cluster: SlurmCluster) -> dict[str, Any]:
    """A two-key sweep of one trial of a task file that only the submitting machine sees."""
    cfg = digits_config(cluster)
    cfg["task"] = HIDDEN_TASK
    cfg["train"]["epochs"] = 1
    cfg["sweep"] = {
        "name": "hidden",
        "parameters": {"train.lr": [GOOD], "train.batch_size": [BATCH]},
    }
    return cfg


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
            text = _finish(proc, out, timeout=360)  # (three trials in turn on a slow day)
        finally:
            self._done.set()
            poller.join()
        return text, proc.returncode


@contextlib.contextmanager
def hidden_on_nodes(cluster: SlurmCluster, folder: Path) -> Iterator[None]:
    """``folder`` empty as the nodes see it (an empty folder bind-mounted over it in their
    mount namespaces): a file the submitting machine has and the nodes do not."""
    empty = folder.parent / ".empty"
    empty.mkdir()
    for node in cluster.nodes:
        cluster.run(["mount", "--bind", str(empty), str(folder)], node=node)
    try:
        yield
    finally:
        for node in cluster.nodes:
            cluster.run(["umount", str(folder)], node=node, check=False)


@pytest.fixture(scope="module")
def calls(slurm_slot: SlurmSlot, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """The three calls side by side: the sweep (after a trial that finished before), the
    scaling study and the sweep of a task the nodes do not see."""
    cluster = slurm_slot.cluster()
    root = tmp_path_factory.mktemp("sweep-slurm")
    workdir, scaling_dir, hidden_dir = root / "wd", root / "scaling", root / "hidden"
    prune = Pruning(method="median", metric="accuracy", direction="maximize", warmup_epochs=1)
    finished = pruning.TrialPruner(
        TrialSection(SWEEP, "finished", {"train.lr": 0.001, "train.batch_size": BATCH}, prune),
        workdir / layout.SweepLayout(SWEEP).journal,
    )  # fmt: skip
    for epoch, accuracy in FINISHED.items():
        finished.report({"epoch": epoch, "test_accuracy": accuracy}, decide=False)
    finished.finish({"epoch": EPOCHS, "test_accuracy": FINISHED[EPOCHS]}, pruned=False)
    task = hidden_dir / HIDDEN_TASK
    task.parent.mkdir(parents=True)
    shutil.copy(REPO / "src/ddppipe/tasks/digits.py", task)
    started = time.monotonic()
    with hidden_on_nodes(cluster, task.parent):
        queue = Queue(cluster, workdir)
        scaling, scaling_out = _start_snakemake(cluster, scaling_dir, scaling_config(cluster),
                                                "scaling")  # fmt: skip
        hidden, hidden_out = _start_snakemake(cluster, hidden_dir, hidden_task_config(cluster),
                                              "sweep")  # fmt: skip
        text, rc = queue.call(sweep_config(cluster, [GOOD, *BAD]))
        scaling_text = _finish(scaling, scaling_out, timeout=240)
        hidden_text = _finish(hidden, hidden_out, timeout=240)
    print(f"(sweeps on SLURM, side by side) {time.monotonic() - started:.0f}s")
    assert rc == 0, text[-6000:]
    result = subprocess.CompletedProcess([], scaling.returncode, "", scaling_text)
    assert scaling.returncode == 0, logs(scaling_dir, result)
    yield {"workdir": workdir, "queue": queue, "text": text, "scaling": scaling_dir,
           "scaling_text": scaling_text, "hidden": hidden_dir, "hidden_text": hidden_text,
           "hidden_rc": hidden.returncode}  # fmt: skip


@pytest.fixture(scope="module")
def sweep(calls: dict) -> dict:
    return calls


def trial_name(lr: float) -> str:
    """The trial's name: its keys in the config's order (the test writes it with sorted keys)."""
    return f"batch_size={BATCH}+lr={lr!r}"


def trial_dir(workdir: Path, lr: float) -> Path:
    return workdir / "results" / "sweeps" / SWEEP / trial_name(lr)


def attempts(workdir: Path, lr: float) -> list[dict[str, Any]]:
    return json.loads((trial_dir(workdir, lr) / "train" / "attempts.json").read_text())


def evaluation(workdir: Path, lr: float) -> dict[str, Any]:
    return json.loads((trial_dir(workdir, lr) / "eval" / "metrics.json").read_text())


def test_no_more_than_max_parallel_training_jobs_at_once(sweep: dict) -> None:
    queue = sweep["queue"]
    assert queue.most == MAX_PARALLEL, (queue.most, queue.seen)
    jobs = train_job_ids(subprocess.CompletedProcess([], 0, "", sweep["text"]))
    assert len(jobs) == 1 + len(BAD) == len(queue.seen), (jobs, queue.seen)


def test_the_trials_train_in_the_grids_order(sweep: dict) -> None:
    """The order listed, the good trial first (Snakemake picked the one whose config file is
    longest: lr 1e-05 first, and nothing could be pruned before the good one)."""
    listed = [GOOD, *BAD]
    starts = [attempts(sweep["workdir"], lr)[0]["start"] for lr in listed]
    assert starts == sorted(starts), dict(zip(listed, starts, strict=True))


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
        assert ckpts == ["ckpt-e0001-s000000"], (lr, ckpts)
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
        trial_name(GOOD): "completed", **{trial_name(lr): "pruned at epoch 1" for lr in BAD}
    }  # fmt: skip
    for lr in (GOOD, *BAD):
        row = rows[trial_name(lr)]
        assert float(row["train.lr"]) == lr and int(row["train.batch_size"]) == BATCH
        accuracy = evaluation(wd, lr)["test_accuracy"]
        assert float(row["accuracy"]) == pytest.approx(accuracy, abs=1e-6)  # 6 digits
    best = json.loads((wd / "results" / "sweeps" / SWEEP / "best.json").read_text())
    assert best["trials"] == {"completed": 1, "pruned": len(BAD), "failed": 0, "running": 0,
                              "pending": 0}  # fmt: skip
    assert best["best"]["trial"] == trial_name(GOOD), best


def test_the_scaling_study_trains_each_trial_on_its_nodes(sweep: dict) -> None:
    study = sweep["scaling"] / "results" / "sweeps" / "scaling"
    with (study / "time_to_accuracy.csv").open() as f:
        rows = {row["trial"]: row for row in csv.DictReader(f)}
    one, two = (
        "nnodes=1+nproc_per_node=1+cpus_per_proc=1",
        "nnodes=2+nproc_per_node=1+cpus_per_proc=1",
    )
    assert set(rows) == {one, two}, rows
    for name, nodes in ((one, 1), (two, 2)):
        history = json.loads((study / name / "train" / "attempts.json").read_text())
        assert len(history) == 1 and history[0]["outcome"] == "completed", history
        assert history[0]["job"] != "local" and len(set(history[0]["nodes"])) == nodes, history
        assert set(history[0]["nodes"]) <= {"cn07", "cn08"}, history
        assert float(rows[name]["final_test_accuracy"]) > 0.2, rows[name]  # chance: 0.1


HIDDEN_TRIAL = f"batch_size={BATCH}+lr={GOOD!r}"


def test_a_job_failing_before_training_is_named_and_not_retried(sweep: dict) -> None:
    wd, text = sweep["hidden"], sweep["hidden_text"]
    assert sweep["hidden_rc"] != 0, text[-4000:]
    jobs = train_job_ids(subprocess.CompletedProcess([], 0, "", text))
    assert len(jobs) == 2, (jobs, text[-6000:])  # the profile's retries would make it 3
    cause = f"WorkflowError: task '{HIDDEN_TASK}': no such file"
    assert f"the same error as SLURM job {jobs[0]}: not retried" in text, text[-6000:]
    with (wd / "results" / "sweeps" / "hidden" / "trials.csv").open() as f:
        rows = {row["trial"]: row for row in csv.DictReader(f)}
    outcome = rows[HIDDEN_TRIAL]["outcome"]
    assert outcome.startswith(f"failed: before training (SLURM job {jobs[1]}): {cause}"), outcome
    # the trial's summary, and the last lines of the call (the sweep's table)
    run = wd / "results" / "sweeps" / "hidden" / HIDDEN_TRIAL
    key, value = summary.text(run).splitlines()[-1].split(None, 1)
    assert key == "failed", (key, value)
    assert value.startswith(f"before training (SLURM job {jobs[1]}): {cause}"), value
    tail = text.strip().splitlines()[-8:]  # Snakemake's own last lines after the table
    assert any(f"failed: {HIDDEN_TRIAL}: before training" in line and cause in line
               for line in tail), tail  # fmt: skip
