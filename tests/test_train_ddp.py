"""Real multi-process DDP training with torchrun on tiny generated data."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from ddppipe import checkpoint, config
from tests.conftest import run_cli
from tests.tiny import TinyData, tiny_config


def launch(cfg: dict, tiny: TinyData, run_dir: Path, command: str = "launch"):
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = run_dir / "config.yaml"
    config.write(config.resolve(cfg), cfg_path)
    result = run_cli(
        command,
        f"--config={cfg_path}",
        f"--data={tiny.data_dir}",
        f"--state={run_dir / 'state'}",
        f"--checkpoint={run_dir / 'final.pt'}",
        f"--metrics={run_dir / 'metrics.jsonl'}",
    )
    return result


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
    assert [p.name for p in checkpoint.Store(straight / "state" / "checkpoints").paths()] == [
        "ckpt-e0001-s000000.pt",
        "ckpt-e0002-s000000.pt",
    ]


def test_resume_in_a_new_process_gives_identical_weights(
    straight: Path, tiny: TinyData, tmp_path: Path
) -> None:
    """Epoch 1 from the straight run, then a new launch resumes for epoch 2."""
    ckpts = tmp_path / "state" / "checkpoints"
    ckpts.mkdir(parents=True)
    shutil.copy(straight / "state" / "checkpoints" / "ckpt-e0001-s000000.pt", ckpts)
    result = launch(tiny_config(tiny, epochs=2), tiny, tmp_path)
    assert "resuming from" in result.stderr and "ckpt-e0001" in result.stderr
    assert_identical(weights(tmp_path / "final.pt"), weights(straight / "final.pt"))
    history = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["epoch"] for m in history] == [1, 2]  # epoch 1's metrics came with the checkpoint


def test_truncated_newest_checkpoint_falls_back_to_the_previous(
    straight: Path, tiny: TinyData, tmp_path: Path
) -> None:
    ckpts = tmp_path / "state" / "checkpoints"
    ckpts.mkdir(parents=True)
    shutil.copy(straight / "state" / "checkpoints" / "ckpt-e0001-s000000.pt", ckpts)
    good = (straight / "state" / "checkpoints" / "ckpt-e0002-s000000.pt").read_bytes()
    (ckpts / "ckpt-e0002-s000000.pt").write_bytes(good[: len(good) // 3])
    result = launch(tiny_config(tiny, epochs=2), tiny, tmp_path)
    assert "unreadable checkpoint" in result.stderr and "falling back" in result.stderr
    assert_identical(weights(tmp_path / "final.pt"), weights(straight / "final.pt"))


def test_plain_process_is_a_world_of_one(tiny: TinyData, tmp_path: Path) -> None:
    """`ddppipe train` without a launcher is a world of one."""
    cfg = tiny_config(tiny)
    cfg["launch"]["nproc_per_node"] = 1
    result = launch(cfg, tiny, tmp_path, command="train")
    assert "single: rank 0/1" in result.stderr
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["train"]["epochs"] == 1
    assert checkpoint.load(tmp_path / "final.pt")["meta"]["world_size"] == 1
