"""Pruning a sweep's trials at epoch ends (ddppipe.training.loop.pruning): real 2-process DDP
trainings of the built-in digits task, each a trial's config as the workflow writes it,
reporting to the sweep's one Optuna journal.

One trial of the sweep finished before (recorded in the journal as its training records it,
with known accuracies, so the median is known); then a trial whose learning rate cannot learn
and one that learns train side by side: the first is pruned at epoch 1 (its checkpoint kept,
its outputs written, the summary saying so), the second goes on to its last epoch.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ddppipe import tasks
from ddppipe.data import manifest
from ddppipe.launching import resolve
from ddppipe.reports import summary
from ddppipe.settings import config, layout
from ddppipe.settings.run_spec import Pruning, TrialSection
from ddppipe.settings.runs import Runs
from ddppipe.training.loop import pruning
from tests.tiny import default_config

SWEEP = "lr"
SLOW, BAD, FAST = "lr=0.001", "lr=1e-05", "lr=0.05"  # the trials, by their names
EPOCHS = 2
FINISHED = {1: 0.5, 2: 0.6}  # the finished trial's (SLOW's) accuracy at each epoch
PRUNE = Pruning(method="median", metric="accuracy", direction="maximize", warmup_epochs=1)


def sweep_config() -> dict[str, Any]:
    """The digits task, 2 short epochs on 2 processes; a grid of three learning rates."""
    cfg = default_config()
    cfg.update(task="ddppipe.tasks.digits", task_args={"width": 8})
    cfg["train"].update(epochs=EPOCHS, batch_size=64)
    cfg["launch"].update(nproc_per_node=2, cpus_per_proc=1)
    cfg["sweep"] = {"name": SWEEP, "parameters": {"train.lr": [0.001, 1e-5, 0.05]},
                    "prune": "median", "prune_warmup_epochs": 1}  # fmt: skip
    return cfg


def start(workdir: Path, runs: Runs, trial: str, data: Path) -> subprocess.Popen:
    """``ddppipe launch`` of the trial's training in ``workdir``, as the train rule runs it."""
    run = layout.RunLayout(layout.SweepLayout(SWEEP).trial(trial).run)
    (workdir / run.root).mkdir(parents=True, exist_ok=True)
    resolve.write_resolved(runs.config(run.run), workdir / run.config, False)
    return subprocess.Popen(
        [sys.executable, "-m", "ddppipe", "launch", "--config", str(run.config),
         "--data", str(data), "--state", str(run.state),
         "--checkpoint", str(run.train.final_checkpoint), "--metrics", str(run.train.metrics),
         "--attempts", str(run.train.attempts), "--log", str(run.log("train"))],
        cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def finish(proc: subprocess.Popen) -> None:
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-4000:]


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sweep's working directory once two trials trained, after one that finished."""
    workdir = tmp_path_factory.mktemp("pruning")
    cfg = config.validate(sweep_config())
    task = tasks.load(cfg["task"])
    data = workdir / "resources" / "digits"
    args = tasks.validate_args(task, cfg["task_args"])
    task.call("prepare", data, args)
    manifest.write(data, task.source.as_dict(), args)
    runs = Runs(cfg)
    assert sorted(t.name for t in runs.trials) == sorted([SLOW, BAD, FAST])
    finished = pruning.TrialPruner(
        TrialSection(SWEEP, SLOW, {"train.lr": 0.001}, PRUNE),
        workdir / layout.SweepLayout(SWEEP).journal,
    )
    for epoch, accuracy in FINISHED.items():
        finished.report({"epoch": epoch, "test_accuracy": accuracy}, decide=False)
    finished.finish({"epoch": EPOCHS, "test_accuracy": FINISHED[EPOCHS]}, pruned=False)
    procs = [start(workdir, runs, trial, data) for trial in (BAD, FAST)]
    for proc in procs:
        finish(proc)
    return workdir


def trial_files(workdir: Path, trial: str) -> tuple[list[dict], dict]:
    """The trial's metrics (one record an epoch) and its final evaluation."""
    train = workdir / layout.SweepLayout(SWEEP).trial(trial).train.root
    history = [json.loads(line) for line in (train / "metrics.jsonl").read_text().splitlines()]
    return history, json.loads((train / "evaluation.json").read_text())


def study_trials(workdir: Path) -> dict[str, Any]:
    """The sweep's Optuna trials by ddppipe trial name, read from its journal."""
    import optuna

    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(
        str(workdir / layout.SweepLayout(SWEEP).journal)))  # fmt: skip
    study = optuna.load_study(study_name=SWEEP, storage=storage)
    return {t.user_attrs["ddppipe_trial"]: t for t in study.trials}


@pytest.mark.slow  # the swept trials (2 worlds)
def test_a_trial_far_below_the_finished_one_is_pruned_at_epoch_1(swept: Path) -> None:
    history, evaluation = trial_files(swept, BAD)
    assert [r["epoch"] for r in history] == [1]
    assert history[0]["test_accuracy"] < FINISHED[1], history
    assert evaluation["pruned_at_epoch"] == 1 and evaluation["epochs"] == 1
    assert evaluation["test_accuracy"] == history[0]["test_accuracy"]
    run = layout.SweepLayout(SWEEP).trial(BAD)
    checkpoints = sorted(p.name for p in (swept / run.state / "checkpoints").glob("ckpt-*"))
    assert checkpoints == ["ckpt-e0001-s000000"]  # (a sharded checkpoint's folder)
    assert (swept / run.train.final_checkpoint).is_file()
    attempts = json.loads((swept / run.train.attempts).read_text())
    assert [a["outcome"] for a in attempts] == ["completed"]
    text = summary.text(swept / run.root)
    outcome = re.findall(r"^  outcome +(.*)$", text, re.M)
    assert outcome == ["pruned at epoch 1 (median rule of sweep lr on accuracy)"], text
    trials = study_trials(swept)
    assert trials[BAD].state.name == "PRUNED"
    assert trials[BAD].intermediate_values == {1: history[0]["test_accuracy"]}
    assert trials[BAD].user_attrs["values"] == {"train.lr": 1e-05}


@pytest.mark.slow  # the swept trials (2 worlds)
def test_a_trial_above_the_median_trains_every_epoch(swept: Path) -> None:
    history, evaluation = trial_files(swept, FAST)
    assert [r["epoch"] for r in history] == list(range(1, EPOCHS + 1))
    # above the finished trial at every epoch: never below the median
    assert all(r["test_accuracy"] > FINISHED[r["epoch"]] for r in history), history
    assert "pruned_at_epoch" not in evaluation and evaluation["epochs"] == EPOCHS
    trials = study_trials(swept)
    assert trials[FAST].state.name == "COMPLETE"
    assert trials[FAST].value == evaluation["test_accuracy"]
    assert trials[FAST].intermediate_values == {r["epoch"]: r["test_accuracy"] for r in history}
    assert trials[SLOW].state.name == "COMPLETE" and trials[SLOW].value == FINISHED[EPOCHS]
    text = summary.text(swept / layout.SweepLayout(SWEEP).trial(FAST).root)
    assert "pruned" not in text, text


def test_an_unknown_metric_names_the_keys_there_are() -> None:
    record = {"epoch": 1, "train_loss": 0.5, "test_loss": 0.4, "test_accuracy": 0.9,
              "test_top3": 0.95}  # fmt: skip
    assert pruning.metric_value(record, "top3") == 0.95
    assert pruning.metric_value(record, "loss") == 0.4
    with pytest.raises(pruning.PruningError) as e:
        pruning.metric_value(record, "f1")
    assert str(e.value).startswith(
        "sweep.metric 'f1': the evaluation has no test_f1; it has accuracy, loss, top3"
    )


def test_a_resumed_trial_continues_its_optuna_trial(tmp_path: Path) -> None:
    """A later slot of a trial (a requeue, a retry) reports into the same Optuna trial; one
    that finished is not told twice; the next trial of that name is a new one."""
    prune = PRUNE
    trial = TrialSection(SWEEP, "lr=0.1", {"train.lr": 0.1}, prune)
    journal = tmp_path / "optuna.journal"
    first = pruning.TrialPruner(trial, journal)
    assert first.report({"epoch": 1, "test_accuracy": 0.5}) is False  # nothing finished yet
    again = pruning.TrialPruner(trial, journal)  # the next slot, in another process
    again.report({"epoch": 1, "test_accuracy": 0.5})  # epoch 1 trained again: kept once
    again.report({"epoch": 2, "test_accuracy": 0.7}, decide=False)
    again.finish({"epoch": 2, "test_accuracy": 0.7}, pruned=False)
    pruning.TrialPruner(trial, journal).finish({"epoch": 2, "test_accuracy": 0.7}, pruned=False)
    study = pruning.open_study(journal, SWEEP, prune)
    assert [(t.state.name, t.value, t.intermediate_values) for t in study.trials] == [
        ("COMPLETE", 0.7, {1: 0.5, 2: 0.7})
    ]
    below = pruning.TrialPruner(TrialSection(SWEEP, "lr=1e-05", {"train.lr": 1e-5}, prune), journal)
    assert below.report({"epoch": 1, "test_accuracy": 0.1}) is True
    halving = Pruning(method="halving", metric="loss", direction="minimize", warmup_epochs=2)
    found = pruning.make_pruner(halving)
    assert type(found).__name__ == "SuccessiveHalvingPruner"
    assert (found._min_resource, found._reduction_factor) == (2, 2)


@pytest.mark.slow  # the swept trials, then a reproduction
def test_a_pruned_trial_reproduces_to_its_pruning_epoch(swept: Path) -> None:
    """`ddppipe reproduce` of the pruned trial trains its 2-epoch schedule to epoch 1, where it
    was pruned, stops there and compares: identical; the sweep's study is not asked or told."""
    run = layout.SweepLayout(SWEEP).trial(BAD)
    subprocess.run([sys.executable, "-m", "ddppipe", "export",
                    f"--result={run.train.weights}", f"--record={run.train.record}",
                    f"--config={run.config}", f"--data={swept / 'resources' / 'digits'}",
                    f"--out={run.export.weights}", f"--provenance={run.export.provenance}",
                    f"--attempts={run.train.attempts}"], cwd=swept, check=True)  # fmt: skip
    journal = (swept / layout.SweepLayout(SWEEP).journal).read_bytes()
    result = subprocess.run([sys.executable, "-m", "ddppipe", "reproduce", str(run.root)],
                            cwd=swept, capture_output=True, text=True)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "  pruned   the trial was pruned at epoch 1: reproduced and compared to it" in \
        result.stdout  # fmt: skip
    assert result.stdout.strip().splitlines()[-1] == "identical"
    again = layout.RunLayout.of_root(swept / "results" / f"{BAD}-reproduced-1")
    assert json.loads(again.train.evaluation.read_text())["pruned_at_epoch"] == 1
    assert (swept / layout.SweepLayout(SWEEP).journal).read_bytes() == journal
