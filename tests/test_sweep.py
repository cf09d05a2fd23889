"""Sweeps through the DAG, locally: a grid, a random and a TPE sweep of a user's task file
(tests/data/blobs.py), a rerun that adds a value, a trial that fails, and bad input refused
at dry run. One working directory (the task's data prepared once) and one snakemake call per
sweep, shared by the assertions (module fixtures)."""

from __future__ import annotations

import copy
import csv
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

from tests.tiny import REPO, default_config
from tests.workflow_helpers import snakemake

TASK = REPO / "tests" / "data" / "blobs.py"


def started(result: subprocess.CompletedProcess, rule: str) -> list[str]:
    """The ``run`` wildcard of every ``rule`` job a snakemake call started, in the order it
    started them (its log)."""
    log = result.stdout + result.stderr
    blocks = re.findall(rf"^(?:local)?rule {rule}:\n((?:[ \t]+.*\n)+)", log, re.M)
    return [m[1] for b in blocks if (m := re.search(r"wildcards: run=(\S+)", b))]


def jobs(result: subprocess.CompletedProcess, rule: str) -> list[str]:
    """The ``run`` wildcard of every ``rule`` job a snakemake call started, sorted."""
    return sorted(started(result, rule))


def sweep_config(**sweep: Any) -> dict[str, Any]:
    """One-epoch CPU runs of the blobs task, with ``sweep`` as the sweep section."""
    cfg = default_config()
    cfg["run"] = "blobs"
    cfg["task"] = "tasks/blobs.py"
    cfg["task_args"] = {"samples": 256}
    cfg["tracking"]["tensorboard"] = False
    cfg["train"].update({"epochs": 1, "batch_size": 32, "eval_batch_size": 64, "lr": 0.05})
    cfg["launch"].update({"nproc_per_node": 1, "device": "cpu", "cpus_per_proc": 1})
    cfg["sweep"] = {"max_parallel": 2, **sweep}
    return cfg


def user_dir(w: Path) -> Path:
    """``w``, a working directory with the task file where a user keeps it (tasks/blobs.py)."""
    (w / "tasks").mkdir(parents=True)
    shutil.copy2(TASK, w / "tasks" / "blobs.py")
    return w


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The working directory of the sweeps that run (the task's data prepared once)."""
    return user_dir(tmp_path_factory.mktemp("sweep"))


def sweep(workdir: Path, cfg: dict[str, Any], *args: str) -> subprocess.CompletedProcess:
    return snakemake(workdir, cfg, "--cores", "2", "sweep", *args, check=False)


def trial_folders(workdir: Path, name: str) -> set[str]:
    root = workdir / "results" / "sweeps" / name
    return {p.name for p in root.iterdir() if (p / "config.yaml").is_file()}


def evaluated(workdir: Path, name: str) -> set[str]:
    """The trials of sweep ``name`` whose final evaluation was written."""
    root = workdir / "results" / "sweeps" / name
    return {p.parent.parent.name for p in root.glob("*/eval/metrics.json")}


# -- a grid: a failing trial, then a rerun that adds a value ------------------------------

# (keys in alphabetical order: the test's config file is written with sorted keys)
GRID = {
    "name": "grid",
    "parameters": {"task_args.activation": ["nope", "relu"], "task_args.hidden": [4]},
}


@pytest.fixture(scope="module")
def grid(workdir: Path) -> dict[str, subprocess.CompletedProcess]:
    """The grid sweep (hidden 4; activation relu, and nope, which the task rejects at its
    first step), then the same sweep with hidden 8 added."""
    first = sweep(workdir, sweep_config(**GRID))
    more = copy.deepcopy(GRID)
    more["parameters"]["task_args.hidden"] = [4, 8]
    again = sweep(workdir, sweep_config(**more))
    return {"first": first, "again": again}


@pytest.mark.slow  # sweeps through the DAG
def test_grid_trials_are_named_after_their_values(grid: dict, workdir: Path) -> None:
    assert trial_folders(workdir, "grid") == {
        "activation=nope+hidden=4", "activation=relu+hidden=4",
        "activation=nope+hidden=8", "activation=relu+hidden=8",
    }  # fmt: skip
    config = (workdir / "results/sweeps/grid/activation=relu+hidden=8/config.yaml").read_text()
    assert "hidden: 8" in config and "activation: relu" in config


@pytest.mark.slow  # sweeps through the DAG
def test_a_failing_trial_fails_and_the_others_complete(grid: dict, workdir: Path) -> None:
    first = grid["first"]
    assert first.returncode != 0
    assert jobs(first, "train") == [
        "sweeps/grid/activation=nope+hidden=4", "sweeps/grid/activation=relu+hidden=4",
    ]  # fmt: skip
    assert evaluated(workdir, "grid") == {"activation=relu+hidden=4", "activation=relu+hidden=8"}
    log = workdir / "logs/sweeps/grid/activation=nope+hidden=4/train.log"
    assert "activation 'nope': torch.nn.functional has no such function" in log.read_text()
    # every trial's ranks forked by the call's warm server (ddppipe.launching.warm), the
    # datasets loaded once by it (the second call: its data prepared before it started); the
    # second call's server the first's, kept between them
    trained = (workdir / "logs/sweeps/grid/activation=relu+hidden=8/train.log").read_text()
    assert "1 of 1 rank(s) forked warm by the warm server" in trained
    assert "kept by the warm server (not loaded again)" in trained
    server = (workdir / "logs/warm-server.log").read_text()
    assert server.count("warm server listening") == 1, server
    assert server.count("warm server adopted by the call of pid") == 1, server


@pytest.mark.slow  # sweeps through the DAG
def test_a_rerun_that_adds_a_value_trains_only_its_trials_and_the_failed(grid: dict) -> None:
    # activation=relu+hidden=4 completed: it is not trained again; the failed one is retried.
    assert jobs(grid["again"], "train") == [
        "sweeps/grid/activation=nope+hidden=4",
        "sweeps/grid/activation=nope+hidden=8",
        "sweeps/grid/activation=relu+hidden=8",
    ]


@pytest.mark.slow  # sweeps through the DAG
def test_each_trial_is_a_run_that_names_its_sweep(grid: dict, workdir: Path) -> None:
    """A trial's provenance names its sweep and values; the table, written at the end of the
    failed call, says why the failed trial failed; the rules that hold no core (threads: 0)
    print no thread-count warning."""
    trial = workdir / "results/sweeps/grid/activation=relu+hidden=8"
    provenance = json.loads((trial / "export/provenance.json").read_text())
    assert provenance["sweep"] == {
        "name": "grid", "trial": "activation=relu+hidden=8",
        "values": {"task_args.activation": "relu", "task_args.hidden": 8},
    }  # fmt: skip
    with open(workdir / "results/sweeps/grid/trials.csv", newline="") as f:
        outcomes = {row["trial"]: row["outcome"] for row in csv.DictReader(f)}
    assert outcomes["activation=relu+hidden=8"] == "completed", outcomes
    assert (
        outcomes["activation=nope+hidden=8"].startswith("failed: crashed (exit 1): rank 0 on ")
        and "ValueError: activation 'nope'" in outcomes["activation=nope+hidden=8"]
    )
    output = grid["first"].stderr + grid["again"].stderr
    assert "Invalid value for environment variable" not in output


# -- a grid's trials in its order ----------------------------------------------------------

ORDERED = {
    "name": "ordered", "max_parallel": 1,
    "parameters": {"task_args.hidden": [8, 4], "train.lr": [0.05, 1e-05, 0.2]},
}  # fmt: skip
# (hidden first, varying slowest: the config file is written with sorted keys; the configs
# of lr 1e-05 are the longest, and Snakemake's selectors ranked ready jobs by input size)


@pytest.fixture(scope="module")
def ordered(workdir: Path) -> subprocess.CompletedProcess:
    """The 6-trial grid, one trial at a time; only its trainings (--until train: cheap)."""
    return sweep(workdir, sweep_config(**ORDERED), "--until", "train")


@pytest.mark.slow  # sweeps through the DAG
def test_a_grid_trains_its_trials_in_their_order(
    ordered: subprocess.CompletedProcess, workdir: Path
) -> None:
    assert ordered.returncode == 0, ordered.stderr[-3000:]
    listed = [f"hidden={h}+lr={lr!r}" for h in (8, 4) for lr in (0.05, 1e-05, 0.2)]
    starts = [attempt(workdir, name, "ordered")["start"] for name in listed]
    assert starts == sorted(starts), dict(zip(listed, starts, strict=True))


# -- random and TPE ---------------------------------------------------------------------

RANDOM = {
    "name": "random", "method": "random", "trials": 2, "seed": 3,
    "parameters": {"train.lr": {"low": 0.01, "high": 0.3, "log": True},
                   "task_args.hidden": {"choices": [4, 8, 16]}},
}  # fmt: skip


def dry_run_trials(workdir: Path, cfg: dict[str, Any]) -> list[str]:
    """The trials a dry run of the sweep would train, in another working directory."""
    result = snakemake(user_dir(workdir), cfg, "-n", "--cores", "2", "sweep")
    return jobs(result, "train")


@pytest.fixture(scope="module")
def random_sweep(workdir: Path) -> subprocess.CompletedProcess:
    return sweep(workdir, sweep_config(**RANDOM))


@pytest.mark.slow  # sweeps through the DAG
def test_a_random_sweep_draws_the_same_trials_again(
    random_sweep: subprocess.CompletedProcess, workdir: Path, tmp_path: Path
) -> None:
    assert random_sweep.returncode == 0, random_sweep.stderr
    trained = evaluated(workdir, "random")
    assert len(trained) == 2
    again = dry_run_trials(tmp_path / "again", sweep_config(**RANDOM))
    assert {r.rsplit("/", 1)[1] for r in again} == trained
    more = dry_run_trials(tmp_path / "more", sweep_config(**{**RANDOM, "trials": 3}))
    assert len(more) == 3 and trained < {r.rsplit("/", 1)[1] for r in more}


TPE = {
    "name": "tpe", "method": "tpe", "trials": 3, "max_parallel": 2, "seed": 0,
    "parameters": {"task_args.pause_s": {"choices": [0.0, 1.0]},
                   "train.lr": {"low": 0.01, "high": 0.3, "log": True}},
}  # fmt: skip
# (seed 0: round 0 draws a slow trial first, paused 1 s a training step, then a quick one)


@pytest.fixture(scope="module")
def tpe_sweep(workdir: Path) -> dict[str, subprocess.CompletedProcess]:
    cfg = sweep_config(**TPE)
    return {"run": sweep(workdir, cfg), "again": sweep(workdir, cfg)}


def attempt(workdir: Path, name: str, sweep: str = "tpe") -> dict[str, Any]:
    """The one attempt of the trial ``name`` of ``sweep`` (its start and end times)."""
    path = workdir / "results/sweeps" / sweep / name / "train/attempts.json"
    (found,) = json.loads(path.read_text())
    return found


@pytest.mark.slow  # sweeps through the DAG
def test_a_tpe_sweep_suggests_a_trial_when_a_slot_frees(tpe_sweep: dict, workdir: Path) -> None:
    """Round 1 takes the slot that frees first: the quick second trial's, while the slow first
    trial still trains (not the first trial's slot, fixed in advance)."""
    assert tpe_sweep["run"].returncode == 0, tpe_sweep["run"].stderr
    rounds = workdir / "results/sweeps/tpe/rounds"
    docs = [json.loads((rounds / f"{k}.json").read_text()) for k in (0, 1)]
    assert [len(d["trials"]) for d in docs] == [2, 1]
    assert [t["number"] for d in docs for t in d["trials"]] == [0, 1, 2]
    names = [t["name"] for d in docs for t in d["trials"]]
    assert all(re.fullmatch(r"pause_s=[01]\.0\+lr=0\.\d+", n) for n in names), names
    assert len(set(names)) == 3 and evaluated(workdir, "tpe") == set(names)
    assert [t["values"]["task_args.pause_s"] for t in docs[0]["trials"]] == [1.0, 0.0]
    slow, quick, third = (attempt(workdir, n) for n in names)
    # the trainings started in the order suggested (the first two together: Snakemake's log)
    assert started(tpe_sweep["run"], "train") == [f"sweeps/tpe/{n}" for n in names]
    # round 0's two trials trained side by side (max_parallel 2), not one after the other
    assert max(slow["start"], quick["start"]) < quick["end"] < slow["end"], names
    # round 1 was suggested once the quick trial had ended (told to the study), and its trial
    # trained in that slot beside the slow one
    assert docs[1]["after_ended"] == [names[1]], docs[1]
    suggested = (rounds / "1.json").stat().st_mtime
    assert quick["end"] <= suggested < slow["end"] and third["start"] < slow["end"]
    study = optuna.load_study(study_name="tpe", storage=JournalStorage(
        JournalFileBackend(str(workdir / "results/sweeps/tpe/optuna.journal"))))  # fmt: skip
    trials = study.get_trials()
    metrics = json.loads(
        (workdir / "results/sweeps/tpe" / names[1] / "eval/metrics.json").read_text()
    )
    assert trials[1].state == TrialState.COMPLETE and trials[1].value == metrics["test_accuracy"]
    assert trials[2].state == TrialState.RUNNING  # the last round: no round after it asks


@pytest.mark.slow  # sweeps through the DAG
def test_a_finished_tpe_sweep_reruns_nothing(tpe_sweep: dict) -> None:
    again = tpe_sweep["again"]
    assert again.returncode == 0, again.stderr
    assert "Nothing to be done" in again.stdout + again.stderr
    assert "2 of 2 rounds suggested so far" in again.stdout + again.stderr


# -- bad input: refused at dry run, before any job -----------------------------------------


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"parameters": {"train.learning_rate": [0.1]}},
         "sweep.parameters.train.learning_rate: not a config key"),
        ({"parameters": {"train.batch_size": [32, -1]}},
         "sweep.parameters.train.batch_size[1]: -1 is not a valid train.batch_size"),
        ({"parameters": {"train.lr": []}},
         "sweep.parameters.train.lr: an empty list gives 0 trials"),
        ({"metric": "f1"}, "sweep.metric: 'f1' is not a metric of the task's evaluation"),
    ],
    ids=["not-a-key", "schema-rejects", "empty", "unknown-metric"],
)  # fmt: skip
def test_bad_input_is_refused_at_dry_run(change: dict, message: str, tmp_path: Path) -> None:
    cfg = sweep_config(name="bad", parameters={"train.lr": [0.1]})
    cfg["sweep"].update(change)
    result = snakemake(user_dir(tmp_path), cfg, "-n", "sweep", check=False)
    assert result.returncode != 0
    assert message in result.stdout + result.stderr
    assert "rule train" not in result.stdout + result.stderr


@pytest.mark.slow  # sweeps through the DAG
def test_a_second_sweep_of_one_name_is_refused(grid: dict, workdir: Path) -> None:
    cfg = sweep_config(name="grid", parameters={"train.lr": [0.1]})
    result = snakemake(workdir, cfg, "-n", "sweep", check=False)
    out = result.stdout + result.stderr
    assert result.returncode != 0
    assert "sweep grid: results/sweeps/grid/sweep.json records another sweep of this name" in out
    assert '"keys": ["task_args.activation", "task_args.hidden"]' in out
    assert '"keys": ["train.lr"]' in out
