"""Users' own code through the whole local DAG: a task file, a torchrun script, a broken task."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from ddppipe.core import hashing, jsonl
from ddppipe.launching import resolve
from ddppipe.runstate import preemption
from ddppipe.runstate.state import StateDir
from tests.documented_build import Build
from tests.tiny import REPO, default_config
from tests.workflow_helpers import job_counts, snakemake

EXAMPLE_TASK = REPO / "examples" / "tasks" / "tinycnn.py"
EXAMPLE_SCRIPT = REPO / "examples" / "scripts" / "train_ddp.py"


def own_config(run: str, **keys: object) -> dict:
    cfg = default_config()
    cfg["run"] = run
    cfg["task_args"] = {}
    cfg["train"].update(epochs=2, batch_size=64, eval_batch_size=256)
    cfg.update(keys)
    return cfg


@pytest.fixture(scope="module")
def task_run(shared_build: Build) -> tuple[Path, dict]:
    """The example task file in a working directory (a copy of examples/), trained for 2
    epochs of batches of 64 on its default 4,000 samples: `snakemake --cores all --config
    task=examples/tasks/tinycnn.py run=tinycnn` of the README, in the shared build."""
    wd = shared_build.other_task
    return wd, shared_build.config(wd, task="examples/tasks/tinycnn.py", run="tinycnn")


@pytest.mark.slow
def test_task_file_trains_evaluates_and_exports(task_run: tuple[Path, dict]) -> None:
    wd, _ = task_run
    run = wd / "results" / "tinycnn"
    task_file = wd / "examples" / "tasks" / "tinycnn.py"
    record = json.loads((run / "export" / "provenance.json").read_text())
    assert record["task"]["path"] == str(task_file.resolve())
    assert record["task"]["sha256"] == hashing.file_sha256(task_file)
    prepared = json.loads((wd / "resources" / "tinycnn" / "manifest.json").read_text())
    assert record["data_sha256"] == {k: v["sha256"] for k, v in prepared["files"].items()}
    resolved = yaml.safe_load((run / "config.yaml").read_text())
    assert resolved["task_source"]["sha256"] == hashing.file_sha256(task_file)
    history = jsonl.read(run / "train" / "metrics.jsonl")
    assert [h["epoch"] for h in history] == [1, 2]
    metrics = json.loads((run / "eval" / "metrics.json").read_text())
    assert metrics["test_loss"] == pytest.approx(history[-1]["test_loss"], rel=1e-4)
    weights = torch.load(run / "export" / "model.pt", weights_only=True)
    final = torch.load(run / "train" / "final.pt")["model"]
    assert weights.keys() == final.keys() and all(torch.equal(weights[k], final[k]) for k in final)


def tensorboard_points(folder: Path, tag: str) -> list[tuple[int, float]]:
    """(step, wall time) of ``tag``'s points as TensorBoard loads them (honouring each slot's
    purge)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(folder))
    accumulator.Reload()
    return [(event.step, event.wall_time) for event in accumulator.Scalars(tag)]


def tensorboard_steps(folder: Path, tag: str) -> list[int]:
    return [step for step, _ in tensorboard_points(folder, tag)]


@pytest.mark.slow
def test_tensorboard_points_of_the_task(task_run: tuple[Path, dict]) -> None:
    """An epoch point each epoch; the train loss at checks (every 10 steps), a second apart at
    the least within an epoch (each point costs the training thread its CPU a moment)."""
    wd, _ = task_run
    folder = wd / "results" / "tinycnn" / "tensorboard"
    steps_per_epoch = 50  # 3,200 training samples (4,000 less 20 % for the test), batch 64
    epoch_points = [step for step, _ in tensorboard_points(folder, "epoch/test_loss")]
    assert epoch_points == [steps_per_epoch, 2 * steps_per_epoch]
    train = tensorboard_points(folder, "train/loss")
    steps = [step for step, _ in train]
    assert steps and steps == sorted(set(steps)) and all(step % 10 == 0 for step in steps)
    within = [later - earlier for (a, earlier), (b, later) in itertools.pairwise(train)
              if a // steps_per_epoch == b // steps_per_epoch]  # fmt: skip
    assert all(gap >= 0.99 for gap in within), train


@pytest.mark.slow
def test_changed_task_file_reruns_only_that_runs_training(task_run: tuple[Path, dict]) -> None:
    """A dry run only; the file is put back as it was, time stamp included."""
    wd, cfg = task_run
    task_file = wd / "examples" / "tasks" / "tinycnn.py"
    original, stat = task_file.read_text(), task_file.stat()
    try:
        task_file.write_text(original + "\n# an edit\n")
        counts = job_counts(wd, cfg)
    finally:
        task_file.write_text(original)
        os.utime(task_file, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert counts == {
        "write_config": 1, "train": 1, "evaluate": 1, "export": 1, "plot_training": 1,
        "attempt_history": 1, "summarize": 1, "all": 1,
    }, counts  # fmt: skip


@pytest.mark.slow  # the DAG, to its refusal
def test_broken_task_fails_before_training_naming_file_and_function(tmp_path: Path) -> None:
    (tmp_path / "tasks").mkdir()
    broken = tmp_path / "tasks" / "broken.py"
    source = EXAMPLE_TASK.read_text().replace("def model(", "def _model(")
    broken.write_text(
        source + "\n\ndef model(args):\n    raise ValueError('no such layer: conv9')\n"
    )
    result = snakemake(tmp_path, own_config("broken", task="tasks/broken.py"), "--cores", "2",
                       check=False)  # fmt: skip
    text = result.stdout + result.stderr
    assert result.returncode != 0
    assert f"task tasks/broken.py ({broken}): model() raised ValueError: no such layer" in text
    assert not (tmp_path / "logs" / "broken" / "train.log").exists()  # nothing trained
    print("(broken task) snakemake printed:", *[ln for ln in text.splitlines() if "model()" in ln])


def test_missing_task_module_is_a_config_error_before_anything_runs(tmp_path: Path) -> None:
    result = snakemake(tmp_path, own_config("x", task="mypkg.tasks.nothere"), "-n", check=False)
    assert result.returncode != 0
    text = result.stdout + result.stderr
    assert "task 'mypkg.tasks.nothere': no importable module of that name" in text
    assert not (tmp_path / "results").exists()


# -- a torchrun script through ddppipe launch -------------------------------------------------


def script_launch(run_dir: Path, epochs: int) -> list[str]:
    """The resolved script config in ``run_dir``; the launch arguments of a run there."""
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = own_config("script", script=str(EXAMPLE_SCRIPT),
                     script_args=["--epochs", str(epochs)])  # fmt: skip
    path = run_dir / "config.yaml"
    resolve.write_resolved(cfg, path)
    outputs, metrics = run_dir / "outputs", run_dir / "metrics.jsonl"
    return [f"--config={path}", f"--state={run_dir / 'state'}", f"--outputs={outputs}",
            f"--metrics={metrics}"]  # fmt: skip


def launch_script(args: list[str], cwd: Path) -> subprocess.Popen:
    log = (cwd / "launch.log").open("a")
    return subprocess.Popen([sys.executable, "-m", "ddppipe", "launch", *args], cwd=cwd,
                            stdout=log, stderr=subprocess.STDOUT)  # fmt: skip


@pytest.mark.slow  # 26 s on 2 cores
def test_script_stops_on_sigterm_and_resumes_with_the_same_weights(tmp_path: Path) -> None:
    """The example script: SIGTERM to the launcher mid-run, the script saves and exits
    job.STOP (75); a relaunch resumes it; weights equal an uninterrupted run's bitwise; the
    logged steps continue without a gap or a duplicate."""
    reference = tmp_path / "reference"
    assert launch_script(script_launch(reference, 3), reference).wait(timeout=300) == 0

    run_dir = tmp_path / "stopped"
    args = script_launch(run_dir, 3)
    proc = launch_script(args, run_dir)
    live = StateDir(run_dir / "state").metrics
    deadline = time.monotonic() + 120
    while len(jsonl.read(live)) < 5:
        assert proc.poll() is None, (run_dir / "launch.log").read_text()
        assert time.monotonic() < deadline, (run_dir / "launch.log").read_text()
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == preemption.EXIT_CODE, (run_dir / "launch.log").read_text()
    assert launch_script(args, run_dir).wait(timeout=300) == 0, (run_dir / "launch.log").read_text()

    history = json.loads((run_dir / "state" / "attempts.json").read_text())
    assert [a["outcome"] for a in history] == ["stopped on SIGTERM", "completed"]
    a = torch.load(reference / "outputs" / "model.pt", weights_only=True)
    b = torch.load(run_dir / "outputs" / "model.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    steps = [r["step"] for r in jsonl.read(run_dir / "metrics.jsonl")]
    assert steps == [r["step"] for r in jsonl.read(reference / "metrics.jsonl")]
    assert steps == sorted(steps)  # in order, a continuation neither repeats nor skips
    # TensorBoard, across the two slots: the same points as the uninterrupted run, once each
    losses = tensorboard_steps(run_dir / "tensorboard", "loss")
    assert losses == tensorboard_steps(reference / "tensorboard", "loss")
    assert losses == sorted(set(losses))


@pytest.mark.slow  # a whole DAG, 12 s on 2 cores
def test_script_through_the_dag(tmp_path: Path) -> None:
    """A script run's evaluation, plots and export: what it logged and what it wrote."""
    cfg = own_config("script", script=str(EXAMPLE_SCRIPT), script_args=["--epochs", "1"])
    snakemake(tmp_path, cfg, "--cores", "2")
    run = tmp_path / "results" / "script"
    logged = jsonl.read(run / "train" / "metrics.jsonl")
    summary = json.loads((run / "eval" / "metrics.json").read_text())
    assert summary["points"] == len(logged) and summary["step"] == logged[-1]["step"]
    assert "test_accuracy" in summary and (run / "eval" / "metrics.png").stat().st_size > 0
    assert (run / "train" / "training_curves.png").stat().st_size > 0
    record = json.loads((run / "export" / "provenance.json").read_text())
    assert record["script"]["sha256"] == hashing.file_sha256(EXAMPLE_SCRIPT)
    assert record["outputs_sha256"] == {
        "model.pt": hashing.file_sha256(run / "export" / "outputs" / "model.pt")
    }
    assert [a["outcome"] for a in record["attempts"]] == ["completed"]
    page = (run / "summary.html").read_text()  # the report's first screen
    assert f"script {EXAMPLE_SCRIPT}" in page and ">logged</th>" in page
