"""Tracking across requeues: each job slot is a fresh process; the files are read back."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from ddppipe.runstate.state import StateDir
from ddppipe.training.tracking import mlflow_log, run_tracking

# One job slot: logs train/loss = step + 1000 * slot at every step and test/accuracy at every
# 10th, then closes the tracker or dies by SIGKILL (after `linger` seconds) without closing it.
SLOT = textwrap.dedent(
    """
    import json, os, signal, sys, time
    from pathlib import Path
    from ddppipe.runstate.state import StateDir
    from ddppipe.training.tracking import run_tracking, tensorboard_log

    spec = json.loads(sys.argv[1])
    tensorboard_log.FLUSH_SECONDS = spec.get("flush_seconds", tensorboard_log.FLUSH_SECONDS)
    tracker = run_tracking.Tracker(
        spec["log_dir"] and Path(spec["log_dir"]), StateDir(Path(spec["state_dir"])),
        mlflow_uri=spec.get("mlflow_uri"),
        run_name="mnist", params=spec.get("params"), tags=spec.get("tags"),
    )
    slot = spec["slot"]
    for step in range(spec["first"], spec["last"] + 1):
        tracker.log(step, {"loss": step + 1000 * slot, "lr": 0.5}, prefix="train")
        if step % 10 == 9 and spec.get("test", True):
            tracker.log(step, {"accuracy": slot + step / 100}, prefix="test")
    if spec["end"] == "close":
        tracker.close()
    else:
        time.sleep(spec.get("linger", 0))
        os.kill(os.getpid(), signal.SIGKILL)
    """
)


# The loggers of the facade and its backends.
LOGGERS = {
    f"ddppipe.training.tracking.{m}" for m in ("run_tracking", "tensorboard_log", "mlflow_log")
}


def run_slot(tmp_path: Path, slot: int, first: int, last: int, end: str, **extra: Any) -> None:
    spec = {
        "log_dir": str(tmp_path / "tensorboard"),
        "state_dir": str(tmp_path / "state"),
        "slot": slot,
        "first": first,
        "last": last,
        "end": end,
        **extra,
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    result = subprocess.run(
        [sys.executable, "-c", SLOT, json.dumps(spec)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    expected = 0 if end == "close" else -signal.SIGKILL
    assert result.returncode == expected, result.stderr
    assert "Traceback" not in result.stderr, result.stderr


def scalars(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of ``tag`` as TensorBoard's loader sees the folder (purges applied)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


@pytest.mark.slow  # 3 slots: 3 worlds
def test_three_slots_give_one_history_without_stale_points(tmp_path: Path) -> None:
    run_slot(tmp_path, 1, 0, 29, "kill")  # checkpoint at 20, killed at 29
    run_slot(tmp_path, 2, 20, 49, "kill")  # resumes at 20, checkpoint at 40, killed at 49
    run_slot(tmp_path, 3, 40, 59, "close")  # resumes at 40, finishes

    log_dir = tmp_path / "tensorboard"
    assert len(list(log_dir.glob("events.out.tfevents.*"))) == 3  # one per slot, one folder
    loss = scalars(log_dir, "train/loss")
    assert [step for step, _ in loss] == list(range(60))
    values = dict(loss)
    assert values[5] == 1005.0
    assert values[19] == 1019.0
    assert values[20] == 2020.0  # slot 1's points at 20..29 were purged
    assert values[29] == 2029.0
    assert values[40] == 3040.0  # slot 2's points at 40..49 were purged
    assert values[59] == 3059.0
    assert [step for step, _ in scalars(log_dir, "train/lr")] == list(range(60))
    # Every tag is purged, not only those the new slot logs first.
    accuracy = scalars(log_dir, "test/accuracy")
    assert [step for step, _ in accuracy] == [9, 19, 29, 39, 49, 59]
    assert [value for _, value in accuracy] == pytest.approx([1.09, 1.19, 2.29, 2.39, 3.49, 3.59])


def test_a_killed_slot_loses_only_its_last_seconds(tmp_path: Path) -> None:
    # No test/ points (which flush at once): only the writer's periodic flush saves these.
    run_slot(tmp_path, 1, 0, 4, "kill", test=False, flush_seconds=1, linger=2.5)
    assert [step for step, _ in scalars(tmp_path / "tensorboard", "train/loss")] == [0, 1, 2, 3, 4]


def test_the_event_file_is_opened_once_a_slot_not_once_a_point(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TensorBoard's stub filesystem opens the event file for each record it appends (one
    open and close a point on the shared filesystem); a slot's writer keeps one open: 300
    points, no open after the writer's, every point read back."""
    from tensorboard.compat.tensorflow_stub.io import gfile

    opened: list[str] = []
    real_open = gfile.io.open

    def counting_open(name: str, *args: Any, **kwargs: Any) -> Any:
        opened.append(str(name))
        return real_open(name, *args, **kwargs)

    monkeypatch.setattr(gfile.io, "open", counting_open)
    tracker = run_tracking.Tracker(tmp_path / "tensorboard", StateDir(tmp_path / "state"))
    tracker.open(0)
    before = len(opened)
    for step in range(1, 151):
        tracker.log(step, {"loss": float(step), "lr": 0.1}, prefix="train")
    tracker.close()
    assert opened[before:] == []
    assert [s for s, _ in scalars(tmp_path / "tensorboard", "train/loss")] == list(range(1, 151))


@pytest.mark.slow  # 16 s on 2 cores
def test_mlflow_slots_continue_one_run(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    params = {"train": {"lr": 0.5, "epochs": 3}, "model": "cnn", "notes": "x" * 7000}
    run_slot(tmp_path, 1, 0, 29, "close", mlflow_uri=uri, params=params, tags={"jobs": "101"})
    run_id = StateDir(tmp_path / "state").mlflow_run_id.read_text().strip()
    run_slot(tmp_path, 2, 20, 39, "close", mlflow_uri=uri, params=params, tags={"jobs": "101,102"})
    assert StateDir(tmp_path / "state").mlflow_run_id.read_text().strip() == run_id

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(mlflow_log.DEFAULT_EXPERIMENT)
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_id == run_id
    assert run.info.run_name == "mnist"
    assert run.info.status == "FINISHED"
    assert run.data.params == {
        "train.lr": "0.5",
        "train.epochs": "3",
        "model": "cnn",
        "notes": "x" * 6000,  # MLflow's limit
    }
    assert run.data.tags["jobs"] == "101,102"
    history = client.get_metric_history(run_id, "train/loss")
    # MLflow keeps slot 1's points at 20..29 next to slot 2's (it cannot delete points).
    assert sorted(m.step for m in history) == sorted([*range(30), *range(20, 40)])
    assert {m.value for m in history if m.step == 25} == {1025.0, 2025.0}
    assert run.data.metrics["train/loss"] == 2039.0
    accuracy = client.get_metric_history(run_id, "test/accuracy")
    assert sorted(m.step for m in accuracy) == [9, 19, 29, 29, 39]
    # The TensorBoard side of the same slots is purged as usual.
    assert [s for s, _ in scalars(tmp_path / "tensorboard", "train/loss")] == list(range(40))


def test_mlflow_alone_writes_no_tensorboard_files(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    run_slot(tmp_path, 1, 0, 9, "close", mlflow_uri=uri, log_dir=None)  # tensorboard: false
    assert not (tmp_path / "tensorboard").exists()
    run_id = StateDir(tmp_path / "state").mlflow_run_id.read_text().strip()
    history = MlflowClient(tracking_uri=uri).get_metric_history(run_id, "train/loss")
    assert sorted(m.step for m in history) == list(range(10))


def test_unreachable_mlflow_never_stops_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    with caplog.at_level(logging.WARNING, logger="ddppipe.training"):
        tracker = run_tracking.Tracker(
            tmp_path / "tensorboard", StateDir(tmp_path / "state"), mlflow_uri="http://127.0.0.1:9"
        )
        for step in range(10):
            tracker.log(step, {"loss": float(step)}, prefix="train")
        tracker.close()
        tracker.log(10, {"loss": 10.0}, prefix="train")  # after close: ignored
    assert [step for step, _ in scalars(tmp_path / "tensorboard", "train/loss")] == list(range(10))
    warnings = [r for r in caplog.records if r.name in LOGGERS]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert warnings[0].levelno == logging.WARNING
    assert warnings[0].name == "ddppipe.training.tracking.mlflow_log"
    assert "MLflow tracking (http://127.0.0.1:9) off" in warnings[0].getMessage()
    assert not StateDir(tmp_path / "state").mlflow_run_id.exists()


def test_unwritable_log_dir_never_stops_training(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING, logger="ddppipe.training"):
        tracker = run_tracking.Tracker(blocker / "tensorboard", StateDir(tmp_path / "state"))
        for step in range(3):
            tracker.log(step, {"loss": 1.0, "bad": "n/a"}, prefix="train")  # type: ignore[dict-item]
        tracker.close()
    messages = [r.getMessage() for r in caplog.records if r.name in LOGGERS]
    assert len(messages) == 2, messages
    assert "'train/bad'" in messages[0]
    assert "TensorBoard tracking off" in messages[1]


def test_flatten_params() -> None:
    assert mlflow_log.flatten({"train": {"lr": 0.1, "sched": {"gamma": 0.7}}, "seed": 1}) == {
        "train.lr": "0.1",
        "train.sched.gamma": "0.7",
        "seed": "1",
    }
    assert mlflow_log.flatten({"mirrors": ["a", "b"], "empty": {}}) == {
        "mirrors": "['a', 'b']",
        "empty": "{}",
    }


def test_import_loads_neither_tensorboard_nor_mlflow() -> None:
    code = (
        "import sys, ddppipe.training.tracking.run_tracking; print(sorted(m for m in"
        " sys.modules if m.split('.')[0] in {'mlflow', 'tensorboard', 'torch'}))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "[]"
