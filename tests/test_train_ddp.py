"""Real multi-process DDP training with torchrun on tiny generated data."""

import dataclasses
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from ddppipe.core import env_names
from ddppipe.reports import goodput
from ddppipe.runstate import preemption, startup
from ddppipe.runstate.state import StateDir
from ddppipe.settings import config
from ddppipe.training.checkpoints import checkpoint, sharded_checkpoint
from ddppipe.training.loop import probes
from tests.conftest import REPO, run_cli
from tests.processes import start_guarded_launch, worker_pids
from tests.tiny import TinyData, make_tiny, tiny_config


def cli_args(cfg: dict, tiny: TinyData, run_dir: Path) -> list[str]:
    """Write ``cfg`` into ``run_dir``; the launch/train arguments of a run there."""
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = run_dir / "config.yaml"
    config.write(config.resolve(cfg, gpus=False), cfg_path)
    return [
        f"--config={cfg_path}",
        f"--data={tiny.data_dir}",
        f"--state={run_dir / 'state'}",
        f"--checkpoint={run_dir / 'final.pt'}",
        f"--metrics={run_dir / 'metrics.jsonl'}",
    ]


def launch(cfg: dict, tiny: TinyData, run_dir: Path, command: str = "launch"):
    return run_cli(command, *cli_args(cfg, tiny, run_dir))


def weights(path: Path) -> dict[str, torch.Tensor]:
    return checkpoint.load(path)["model"]


def assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.fixture(scope="module")
def straight(tiny: TinyData, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two epochs without interruption, 2 processes."""
    run_dir = tmp_path_factory.mktemp("straight")
    result = launch(tiny_config(tiny, epochs=2), tiny, run_dir)
    assert "rank 0/2" in result.stderr and "backend gloo" in result.stderr
    return run_dir


@pytest.fixture(scope="module")
def tiny640(tmp_path_factory: pytest.TempPathFactory) -> TinyData:
    """640 training images: 40 steps an epoch at a global batch of 16."""
    return make_tiny(tmp_path_factory.mktemp("tiny640"), n_train=640)


@pytest.fixture(scope="module")
def reference640(tiny640: TinyData, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three epochs of 40 steps without interruption, 2 processes."""
    run_dir = tmp_path_factory.mktemp("reference640")
    launch(tiny_config(tiny640, epochs=3, batch_size=16), tiny640, run_dir)
    return run_dir


def test_two_process_torchrun_writes_metrics_and_checkpoints(straight: Path) -> None:
    lines = [json.loads(x) for x in (straight / "metrics.jsonl").read_text().splitlines()]
    assert [m["epoch"] for m in lines] == [1, 2]
    for m in lines:
        assert m["world_size"] == 2
        assert {
            "train_loss",
            "test_loss",
            "test_accuracy",
            "images_per_s",
            "epoch_seconds",
        } <= m.keys()
        assert m["images_per_s"] > 0 and 0 <= m["test_accuracy"] <= 1
    snap = checkpoint.load(straight / "final.pt")
    assert snap["epoch"] == 2 and snap["meta"]["world_size"] == 2
    assert len(snap["rng"]) == 2
    stored = sharded_checkpoint.Store(straight / "state" / "checkpoints").paths()
    assert [p.name for p in stored] == ["ckpt-e0001-s000000", "ckpt-e0002-s000000"]
    assert sharded_checkpoint.read_state(stored[-1])["rng"] == 2  # (each rank's in its file)


def test_the_slot_records_where_its_time_went(straight: Path) -> None:
    """Rank 0's figures of the slot, in its attempt record
    (ddppipe.training.measuring.efficiency)."""
    (attempt,) = json.loads((straight / "state" / "attempts.json").read_text())
    figures = attempt["efficiency"]
    assert figures["flops_per_image"] == 71_565_312  # the seeds' CNN: 71.6 MFLOP an image
    assert figures["images"] == 2 * 256  # 2 epochs of the 256 tiny training images
    assert figures["train_s"] > 0 and figures["evaluate_s"] > 0 and figures["checkpoint_s"] > 0
    # One at each epoch's end, none by time (train.checkpoint_minutes off)
    assert (figures["checkpoints"], figures["timed_checkpoints"]) == (2, 0)
    assert 0 < figures["checkpoint_max_s"] <= figures["checkpoint_s"]
    # What the saves cost besides: their copies (DDP: off the training thread) and writes
    assert 0 < figures["checkpoint_copy_max_s"] <= figures["checkpoint_copy_s"]
    assert 0 < figures["checkpoint_write_max_s"] <= figures["checkpoint_write_s"]
    assert 0 < figures["warmup_s"] < figures["train_s"]  # the first 10 of the 16 steps
    assert 0 < figures["startup_s"] < attempt["end"] - attempt["start"]
    # train.cuda_graphs (auto) decided at start-up, with its reason (training.loop.graphs)
    assert attempt["cuda_graphs"] == {
        "configured": "auto", "capture": False,
        "reason": "the step runs on cpu, not a CUDA GPU: CUDA graphs are a GPU's",
    }  # fmt: skip
    # Its start-up in parts (ddppipe.runstate.startup): a local slot from its launcher's
    # start, its ranks started cold (each imports torch), no preflight, no checkpoint yet
    parts = startup.of_attempt(attempt)
    assert list(parts) == ["launcher", "launch", "interpreter", "imports", "process group",
                           "data", "model", "checkpoint load", "first step"]  # fmt: skip
    assert all(seconds >= 0 for seconds in parts.values())
    assert parts["imports"] > parts["process group"]  # torch's import, cold
    assert figures["startup_s"] == pytest.approx(sum(parts.values()) - parts["first step"])
    assert attempt["marks"]["rank_first_step"] == pytest.approx(
        attempt["start"] + sum(parts.values())
    )
    assert "startup_marks" not in figures  # (taken into the record's marks)
    assert figures["images_per_s"] == pytest.approx(2 * figures["images_per_s_per_process"])
    assert figures["achieved_gflops"] == pytest.approx(71_565_312 * figures["images_per_s"] / 1e9)
    assert figures["cpu_s"] > 0 and figures["memory_peak_mb"] > 100  # torch alone is more
    # The all-reduce probe at the end of the warm-up (step 10, in epoch 2): its steps are
    # dropped (test_truncated_newest_checkpoint_falls_back_to_the_previous: bitwise without it).
    assert figures["communication_probe_s"] > 0
    assert 0 <= figures["communication_share"] <= 1 and figures["communication_s"] >= 0
    assert not any(key.startswith("gpu_") for key in figures)  # a CPU run: no NVML figures
    evaluation = json.loads((straight / "evaluation.json").read_text())
    history = [json.loads(x) for x in (straight / "metrics.jsonl").read_text().splitlines()]
    assert evaluation["test_accuracy"] == history[-1]["test_accuracy"]
    assert evaluation["test_count"] == 128 and len(evaluation["confusion_matrix"]) == 10


def test_truncated_newest_checkpoint_falls_back_to_the_previous(
    straight: Path, tiny: TinyData, tmp_path: Path
) -> None:
    """The newest checkpoint damaged: a new launch resumes the one before (epoch 1's)."""
    ckpts = tmp_path / "state" / "checkpoints"
    for name in ("ckpt-e0001-s000000", "ckpt-e0002-s000000"):
        shutil.copytree(straight / "state" / "checkpoints" / name, ckpts / name)
    state_file = ckpts / "ckpt-e0002-s000000" / sharded_checkpoint.STATE
    state_file.write_bytes(state_file.read_bytes()[:100])
    result = launch(tiny_config(tiny, epochs=2), tiny, tmp_path)
    assert "unreadable state.pt" in result.stderr and "falling back" in result.stderr
    assert "resuming from" in result.stderr and "ckpt-e0001" in result.stderr
    # a new launch resumed epoch 1's checkpoint: epoch 2 as the straight run's, bitwise
    assert_identical(weights(tmp_path / "final.pt"), weights(straight / "final.pt"))
    history = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["epoch"] for m in history] == [1, 2]  # epoch 1's metrics came with the checkpoint


def test_a_world_of_one_trains_unwrapped_without_host_reads_and_resumes_at_two(
    tiny: TinyData, tmp_path: Path
) -> None:
    """`ddppipe train` without a launcher is a world of one: its model trains without DDP's
    wrapper, and ddppipe's own code reads no tensor on the host inside an epoch when its
    decisions lag as on a GPU (tests/host_reads_probe.py: 32 steps an epoch, checks at 10, 20
    and 30; the reads at an epoch's end, its loss and evaluation, counted at its last step).
    Its checkpoint of epoch 1 resumes at 2 ranks."""
    cfg = tiny_config(tiny, batch_size=8, epochs=2)  # 32 steps an epoch
    cfg["launch"]["nproc_per_node"] = 1
    counts, alone = tmp_path / "reads.json", tmp_path / "alone"
    result = subprocess.run(
        [sys.executable, "-m", "tests.host_reads_probe", str(counts), "train",
         *cli_args(cfg, tiny, alone)], cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "single: rank 0/1" in result.stderr
    assert "one rank: the model trains as it is (no DistributedDataParallel)" in result.stderr
    reads = {int(step): n for step, n in json.loads(counts.read_text()).items()}
    assert set(reads) == {32, 64}, reads  # none in steps 1..31 and 33..63
    assert yaml.safe_load((alone / "config.yaml").read_text())["train"]["epochs"] == 2
    assert checkpoint.load(alone / "final.pt")["meta"]["world_size"] == 1
    two = tmp_path / "two"
    shutil.copytree(alone / "state" / "checkpoints" / "ckpt-e0001-s000000",
                    two / "state" / "checkpoints" / "ckpt-e0001-s000000")  # fmt: skip
    again = launch(tiny_config(tiny, batch_size=8, epochs=2), tiny, two)
    assert "rank 0/2" in again.stderr and "resuming from" in again.stderr
    history = [json.loads(x) for x in (two / "metrics.jsonl").read_text().splitlines()]
    assert [(m["epoch"], m["world_size"]) for m in history] == [(1, 1), (2, 2)]


@pytest.mark.slow  # 20 s on 2 cores
def test_sigterm_to_the_launcher_checkpoints_exits_75_and_resumes_identically(
    tiny640: TinyData, reference640: Path, tmp_path: Path
) -> None:
    """`kill` of a local `ddppipe launch`: the ranks checkpoint, it exits 75; a relaunch
    resumes there and ends with the weights of an uninterrupted run."""
    tiny, reference = tiny640, reference640
    cfg = tiny_config(tiny, epochs=3, batch_size=16)  # 40 steps an epoch

    run_dir = tmp_path / "stopped"
    args = cli_args(cfg, tiny, run_dir)
    proc, log = start_guarded_launch(args, run_dir)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == preemption.EXIT_CODE, log.read_text()
    text = log.read_text()
    assert "training stopped (stopped on SIGTERM) after writing" in text, text
    assert not (run_dir / "final.pt").exists()
    assert not StateDir(run_dir / "state").stop_note.exists()  # the launcher took the note
    stored = sharded_checkpoint.Store(run_dir / "state" / "checkpoints").paths()
    assert stored, f"no checkpoint after SIGTERM:\n{text}"

    result = run_cli("launch", *args, cwd=run_dir)
    assert f"resuming from {stored[-1]}" in result.stderr, result.stderr
    assert_identical(weights(run_dir / "final.pt"), weights(reference / "final.pt"))


def test_sigkill_of_the_launcher_stops_training_with_a_checkpoint(tmp_path: Path) -> None:
    """No orphaned ranks: torchrun gets SIGTERM when its launcher dies, the ranks checkpoint."""
    tiny = make_tiny(tmp_path / "tiny", n_train=640)
    run_dir = tmp_path / "killed"
    proc, log = start_guarded_launch(cli_args(tiny_config(tiny, epochs=50), tiny, run_dir), run_dir)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 60
    while worker_pids(run_dir):
        assert time.monotonic() < deadline, f"training outlived its launcher:\n{log.read_text()}"
        time.sleep(0.2)
    assert sharded_checkpoint.Store(run_dir / "state" / "checkpoints").paths(), log.read_text()
    assert StateDir(run_dir / "state").stop_note.exists()  # nobody took it: the launcher died


def test_a_packed_trial_started_at_its_allocations_warning_stops_by_its_own_clock(
    tiny: TinyData, tmp_path: Path
) -> None:
    """A packed trial whose allocation warns as it starts (no signal comes: its ranks could
    not take one yet) stops at its first steps with a checkpoint, exit 75, goes on later."""
    from ddppipe.runstate import attempts

    run_dir = tmp_path / "packed"
    now = time.time()
    packed = {env_names.PACKED_SLOT: "7 cn07/0",
              env_names.ALLOCATION_END: f"{now - 1:.3f} {now + 60:.3f}"}  # fmt: skip
    args = cli_args(tiny_config(tiny, epochs=50), tiny, run_dir)
    result = run_cli("launch", *args, check=False, env=packed, timeout=120)
    assert result.returncode == preemption.EXIT_CODE, result.stderr[-3000:]
    (slot,) = attempts.read(run_dir / "state/attempts.json")
    assert (slot.job, slot.slot, slot.outcome) == ("7", "cn07/0", "stopped on SIGUSR1")
    assert slot.checkpoint is not None and slot.end_step is not None
    assert slot.end_step < 50 * 10  # stopped within its first epoch, not at the end
    assert not (run_dir / "final.pt").exists()


# MNIST's task and model, each training forward slowed down by PACE_S seconds; rank 1's
# CRASH_AT-th training forward raises.
PACED_TASK = '''\
"""MNIST, paced; a crash on rank 1 when asked."""

import os
import time

import torch

from ddppipe.tasks import mnist
from ddppipe.tasks.mnist import ARGS_SCHEMA, datasets, prepare  # noqa: F401

forwards = 0


def model(args: dict) -> torch.nn.Module:
    net = mnist.model(args)  # the same weights: a hook, no wrapper
    net.register_forward_pre_hook(paced)
    return net


def paced(module: torch.nn.Module, inputs: tuple) -> None:
    global forwards
    if module.training and torch.is_grad_enabled():
        forwards += 1
        time.sleep(float(os.environ["PACE_S"]))
        if os.environ["RANK"] == "1" and forwards == int(os.environ.get("CRASH_AT", "0")):
            raise RuntimeError(f"crash at training forward {forwards}")
'''


@pytest.mark.slow  # 35-50 s on 2 cores
def test_a_crash_resumes_from_the_newest_checkpoint_by_time_mid_epoch_identically(
    tiny640: TinyData, reference640: Path, tmp_path: Path
) -> None:
    """train.checkpoint_minutes shorter than the ranks' 10 steps between agreements (0.24 s,
    steps paced to 0.05 s): a checkpoint at every agreement. Rank 1 crashes in epoch 2; the
    relaunch resumes at its newest checkpoint, mid-epoch, and ends with the weights of an
    uninterrupted run without checkpoints by time: each checkpoint's copy was taken while the
    next step's forward and backward ran (DDP), and holds the weights of its step."""
    from ddppipe.runstate import attempts

    task = tmp_path / "tasks" / "paced.py"
    task.parent.mkdir()
    task.write_text(PACED_TASK)
    cfg = tiny_config(tiny640, epochs=3, batch_size=16, checkpoint_minutes=0.004)
    cfg["task"] = str(task)
    cfg["task_args"]["batchnorm"] = True  # the fast preset's model of ddppipe.tasks.mnist
    args = cli_args(cfg, tiny640, tmp_path / "run")
    # Step 70's forward on rank 1 (the 10th step is followed by the all-reduce probe's
    # forwards), 9 steps after the checkpoint at step 60 started.
    crash = {"PACE_S": "0.05", "CRASH_AT": str(70 + 2 * probes.COMM_PROBES)}
    crashed = run_cli("launch", *args, check=False, env=crash)
    assert crashed.returncode != 0, crashed.stderr[-3000:]
    (first,) = attempts.read(tmp_path / "run/state/attempts.json")
    assert first.failure is not None and first.failure["step"] == 70, first.failure
    stored = sharded_checkpoint.Store(tmp_path / "run/state/checkpoints").paths()
    # Every 10 steps: e0000-s000010 ... e0001-s000020; the newest train.keep_checkpoints kept.
    assert [p.name for p in stored] == ["ckpt-e0001-s000010", "ckpt-e0001-s000020"]

    done = run_cli("launch", *args, env={"PACE_S": "0.05"})
    assert "resuming from" in done.stderr and "ckpt-e0001-s000020" in done.stderr
    history = attempts.read(tmp_path / "run/state/attempts.json")
    assert (history[1].resumed_from, history[1].start_step) == ("ckpt-e0001-s000020", 60)
    # 9 steps redone (60 to 69), where the epoch's start (step 40) would have redone 29.
    figures = history[1].efficiency
    assert figures is not None
    # goodput from the real records: the crashed slot's 9 steps redone, the rest kept
    run = goodput.account([dataclasses.asdict(a) for a in history])
    assert run is not None and run.total.redone_steps == 9, run
    assert 0 < run.total.kept < run.total.held and "failure" in run.total.losses, run
    # By time: epoch 2's step 30, epoch 3's steps 10, 20, 30; at epochs' ends: 2 more.
    assert (figures["timed_checkpoints"], figures["checkpoints"]) == (4, 6)
    assert 0 < figures["checkpoint_max_s"] <= figures["checkpoint_s"]
    assert 0 < figures["checkpoint_copy_max_s"] <= figures["checkpoint_copy_s"]
    assert 0 <= figures["checkpoint_queued_s"] <= figures["checkpoint_s"]
    stored = sharded_checkpoint.Store(tmp_path / "run/state/checkpoints").paths()
    assert [p.name for p in stored] == ["ckpt-e0002-s000030", "ckpt-e0003-s000000"]
    assert_identical(weights(tmp_path / "run/final.pt"), weights(reference640 / "final.pt"))
