"""Weights & Biases across requeues, offline: the ``.wandb`` files read back as W&B's records.

No network and no login: W&B runs offline, its config and cache in the test's folder.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import struct
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ddppipe.runstate import attempts, preemption
from ddppipe.runstate.state import StateDir
from ddppipe.training.tracking import run_tracking
from tests.conftest import run_cli
from tests.processes import start_guarded_launch, worker_pids
from tests.test_train_ddp import cli_args
from tests.tiny import make_tiny, tiny_config

WANDB = {"project": "ddppipe-tests", "entity": None, "mode": "offline"}


@pytest.fixture(autouse=True)
def offline_wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """W&B offline and silent, every file of its own (login, settings, cache) in tmp_path."""
    home = tmp_path / "home"
    home.mkdir()
    for name in [k for k in os.environ if k.startswith("WANDB_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(home))  # no ~/.netrc of the user's
    monkeypatch.setenv("NETRC", str(home / ".netrc"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    for var, sub in (("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"),
                     ("WANDB_DATA_DIR", "data"), ("WANDB_ARTIFACT_DIR", "artifacts")):  # fmt: skip
        monkeypatch.setenv(var, str(home / sub))


def records(path: Path) -> Iterator[Any]:
    """The records of a ``.wandb`` file (W&B's LevelDB-style log of ``wandb.proto`` Records:
    a 7-byte header, 32 KiB blocks of chunks each with a 7-byte header of its own)."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0), path
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (length, kind) == (0, 0):  # a block's padding
            pos += left
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


class Offline:
    """What the offline folders of one run hold, in their start order."""

    def __init__(self, wandb_dir: Path) -> None:
        self.folders = sorted(wandb_dir.glob("offline-run-*"))
        self.runs: list[Any] = []
        self.rows: list[dict[str, Any]] = []  # each history row: its step and values
        self.summary: dict[str, Any] = {}
        self.artifacts: list[Any] = []
        for folder in self.folders:
            (file,) = folder.glob("run-*.wandb")
            for record in records(file):
                self._take(record)

    def _take(self, record: Any) -> None:
        kind = record.WhichOneof("record_type")
        if kind == "run":
            self.runs.append(record.run)
        elif kind == "history":
            row = {"/".join(i.nested_key) or i.key: json.loads(i.value_json)
                   for i in record.history.item}  # fmt: skip
            self.rows.append({**row, "_step": record.history.step.num})
        elif kind == "summary":
            for item in record.summary.update:
                keys = list(item.nested_key) or [item.key]
                self.summary["/".join(keys)] = json.loads(item.value_json)
        elif kind == "artifact":
            self.artifacts.append(record.artifact)

    def steps(self, key: str) -> list[int]:
        """The steps of ``key``'s points, in the order they were written."""
        return [row["_step"] for row in self.rows if key in row]

    def values(self, key: str) -> dict[int, float]:
        return {row["_step"]: row[key] for row in self.rows if key in row}


@pytest.mark.slow  # two slots of a 2-process training: 32 s on 2 cores (55 s when loaded)
def test_a_run_stopped_and_continued_is_one_wandb_run(tmp_path: Path) -> None:
    """A local run stopped by SIGUSR1 at its first step check (a checkpoint at step 10) and
    continued: one W&B run id, every point once, the steps of the uninterrupted run."""
    tiny = make_tiny(tmp_path / "tiny", n_train=320)
    cfg = tiny_config(tiny, epochs=2, batch_size=16)  # 20 steps an epoch
    cfg["tracking"] = {"tensorboard": False, "wandb": WANDB}
    run_dir = tmp_path / "run"
    args = cli_args(cfg, tiny, run_dir)
    proc, log = start_guarded_launch(args, run_dir)
    workers = worker_pids(run_dir)
    for pid in workers:
        os.kill(pid, signal.SIGUSR1)
    assert proc.wait(timeout=120) == preemption.EXIT_CODE, log.read_text()
    run_cli("launch", *args, cwd=run_dir)
    history = attempts.load(StateDir(run_dir / "state"))
    assert [a.outcome for a in history] == ["stopped on SIGUSR1", "completed"]
    assert history[0].checkpoint == "ckpt-e0000-s000010"

    found = Offline(run_dir / "wandb")
    run_id = (run_dir / "state/wandb_run_id").read_text().strip()
    assert run_id.startswith("tiny-")
    assert len(found.folders) == 2  # one per slot, each named by the one run id
    assert all(f.name.endswith(f"-{run_id}") for f in found.folders)
    assert [(r.run_id, r.project, r.display_name) for r in found.runs] == [
        (run_id, "ddppipe-tests", "tiny")
    ] * 2
    # A train point every 10 steps but at epoch starts, an epoch point at each epoch's end:
    # slot 1 logged step 10, slot 2 from 20, none twice, none missing.
    assert found.steps("train/loss") == [10, 30]
    assert found.steps("train/lr") == [10, 30]
    assert found.steps("epoch/test_accuracy") == [20, 40]
    steps = [row["_step"] for row in found.rows]
    assert steps == sorted(set(steps))  # strictly increasing over both folders

    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_loss = [pytest.approx(m["train_loss"]) for m in metrics]
    assert found.values("epoch/train_loss") == {20: train_loss[0], 40: train_loss[1]}
    evaluation = json.loads((run_dir / "evaluation.json").read_text())
    outcome, provenance = found.summary["outcome"], found.summary["provenance"]
    assert outcome["test_accuracy"] == pytest.approx(evaluation["test_accuracy"])
    assert outcome["epochs"] == 2
    assert provenance["config_hash"] == evaluation["config_hash"]
    assert provenance["meta"]["world_size"] == 2
    assert found.summary["efficiency"]["steps"] == 30  # the last slot's: steps 10 to 39
    (model,) = found.artifacts
    assert (model.name, model.type) == ("model", "model")
    (entry,) = model.manifest.contents
    assert entry.ref == (run_dir / "model.pt").resolve().as_uri()
    assert entry.size == (run_dir / "model.pt").stat().st_size


# One job slot of a run: logs train/loss = step + 1000 * slot at every step, its checkpoints
# committed at every 10th step; then closes the tracker or dies by SIGKILL (after `linger` s).
SLOT = textwrap.dedent(
    """
    import json, os, signal, sys, time
    from pathlib import Path
    from ddppipe.runstate.state import StateDir
    from ddppipe.training.tracking import run_tracking

    spec = json.loads(sys.argv[1])
    tracker = run_tracking.Tracker(None, StateDir(Path(spec["state"])), run_name=spec["name"],
                               params=spec["params"], wandb=spec["wandb"], group=spec["group"])
    slot = spec["slot"]
    for step in range(spec["first"], spec["last"] + 1):
        tracker.log(step, {"loss": step + 1000 * slot}, prefix="train")
        if step % 10 == 9:
            tracker.checkpointed(step - 4)
    tracker.summary({"outcome": {"test_accuracy": spec.get("accuracy", 0.0)}})
    if spec["end"] == "close":
        tracker.close()
    else:
        time.sleep(spec["linger"])
        os.kill(os.getpid(), signal.SIGKILL)
    """
)


def run_slot(state: Path, slot: int, first: int, last: int, end: str, **extra: Any) -> None:
    spec = {"state": str(state), "name": "mnist", "params": {"train": {"lr": 0.5}},
            "wandb": WANDB, "group": None, "slot": slot, "first": first, "last": last,
            "end": end, **extra}  # fmt: skip
    state.parent.mkdir(parents=True, exist_ok=True)
    result = subprocess.run([sys.executable, "-c", SLOT, json.dumps(spec)], cwd=state.parent,
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == (0 if end == "close" else -signal.SIGKILL), result.stderr
    assert "Traceback" not in result.stderr and "W&B" not in result.stderr, result.stderr


def test_a_killed_slots_points_after_its_last_checkpoint_are_logged_once(tmp_path: Path) -> None:
    """Slot 1 logs steps 0..29, its last checkpoint at 25, and is killed; slot 2 resumes at
    25: W&B has each step once, slot 1's up to 25, slot 2's after."""
    state = tmp_path / "run" / "state"
    run_slot(state, 1, 0, 29, "kill", linger=4)  # W&B writes its file every 2 s
    run_slot(state, 2, 26, 39, "close")
    found = Offline(tmp_path / "run" / "wandb")
    assert len(found.folders) == 2
    assert found.steps("train/loss") == list(range(40))
    loss = found.values("train/loss")
    assert [loss[s] for s in (0, 25, 26, 39)] == [1000, 1025, 2026, 2039]
    assert {r.run_id for r in found.runs} == {(state / "wandb_run_id").read_text().strip()}
    assert found.runs[0].config.update  # the run's config, as W&B's config
    config = {u.key: json.loads(u.value_json) for u in found.runs[0].config.update}
    assert config["train"] == {"lr": 0.5}


# Trials of a sweep, one after the other: each its tracker as its config asks (rank 0's), a
# point at steps 0..9, its outcome, closed.
TRIALS = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from ddppipe.runstate.state import StateDir
    from ddppipe.settings import run_spec
    from ddppipe.training.tracking import run_tracking

    for i, folder in enumerate(map(Path, sys.argv[1:])):
        spec = run_spec.load(folder / "config.yaml")
        tracker = run_tracking.of_run(spec, StateDir(folder / "state"), "cafe0123")
        for step in range(10):
            tracker.log(step, {"loss": 1.0 / (step + 1)}, prefix="train")
        tracker.summary({"outcome": {"test_accuracy": 0.5 + i / 10}})
        tracker.close()
    """
)


def test_a_sweeps_trials_are_one_wandb_group(tmp_path: Path) -> None:
    """Two trials of the sweep 'lr', their configs as write_config leaves them: two runs of
    the group 'lr', each with its values in its config and its outcome in its summary."""
    from bench import sweep_table
    from ddppipe.settings import config, layout, sweep

    cfg = sweep_table.base_config({"name": "lr", "parameters": {"train.lr": [0.01, 0.1]}})
    cfg["tracking"] = {"tensorboard": False, "wandb": WANDB}
    found = sweep.from_config(cfg)
    assert found is not None
    folders = []
    for trial in sweep.trials(found):
        run = layout.RunLayout(trial.run, tmp_path / "results")
        resolved = sweep_table.resolved_trial(cfg, found, trial)
        config.write({**resolved, "task_source": sweep_table.TASK_SOURCE}, run.config)
        folders.append(str(run.root))
    result = subprocess.run([sys.executable, "-c", TRIALS, *folders], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0 and "W&B" not in result.stderr, result.stderr
    expected = [("lr=0.01", 0.01, "sweeps-lr-lr-0-01-", 0.5),
                ("lr=0.1", 0.1, "sweeps-lr-lr-0-1-", 0.6)]  # fmt: skip
    for trial, lr, id_start, accuracy in expected:
        found_files = Offline(tmp_path / "results/sweeps/lr" / trial / "wandb")
        (run,) = found_files.runs
        group = (run.run_group, run.job_type, run.display_name)
        assert group == ("lr", "trial", f"sweeps/lr/{trial}")
        assert run.run_id.startswith(id_start)
        values = {u.key: json.loads(u.value_json) for u in run.config.update}
        assert values["trial"]["values"] == {"train.lr": lr}
        assert values["train"]["lr"] == lr
        assert found_files.summary["outcome"] == {"test_accuracy": pytest.approx(accuracy)}
        assert found_files.summary["tags"]["config_hash"] == "cafe0123"
        # No checkpoint: every point sent when the trial's tracker closes.
        assert found_files.steps("train/loss") == list(range(10))


def test_a_failing_wandb_never_stops_training(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """W&B's folder cannot be made: one warning, W&B off, the other calls ignored."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING, logger="ddppipe.training"):
        tracker = run_tracking.Tracker(None, StateDir(blocker / "state"), wandb=WANDB)
        for step in range(3):
            tracker.log(step, {"loss": 1.0}, prefix="train")
        tracker.checkpointed(2)
        tracker.log(3, {"loss": 1.0}, prefix="train")
        tracker.summary({"outcome": {"test_accuracy": 0.5}})
        tracker.close()
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("ddppipe")]
    assert len(messages) == 1, messages
    assert messages[0].startswith("W&B tracking off for this process: ")


def test_import_loads_no_wandb() -> None:
    code = (
        "import sys, ddppipe.training.tracking.run_tracking,"
        " ddppipe.training.tracking.wandb_log;"
        " print(sorted(m for m in sys.modules if m.split('.')[0] == 'wandb'))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "[]"


def test_the_wandb_section_is_checked() -> None:
    from ddppipe.settings import config, run_spec
    from tests.tiny import default_config

    cfg = default_config()
    cfg["tracking"]["wandb"] = {"project": "mnist"}
    spec = run_spec.RunSpec.from_config(config.resolve(cfg, gpus=False))
    assert dict(spec.tracking.wandb) == {"project": "mnist"}  # entity, mode: W&B's, offline
    assert (
        run_spec.RunSpec.from_config(config.resolve(default_config(), gpus=False)).tracking.wandb
        is None
    )
    for bad, message in (({"project": "mnist", "mode": "shared"}, "tracking.wandb.mode"),
                         ({"entity": "me"}, "'project' is a required property")):  # fmt: skip
        cfg["tracking"]["wandb"] = bad
        with pytest.raises(config.ConfigError, match=message):
            config.resolve(cfg, gpus=False)
