"""The training presets: complete recipes, and both train for real on tiny data."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from ddppipe import config, presets
from tests.conftest import run_cli
from tests.tiny import TinyData, default_config, tiny_config


def launch(cfg: dict[str, Any], tiny: TinyData, run_dir: Path) -> None:
    """Resolve ``cfg`` into ``run_dir`` and train with ``ddppipe launch`` (torchrun)."""
    config.write(config.resolve(cfg), run_dir / "config.yaml")
    run_cli(
        "launch",
        f"--config={run_dir / 'config.yaml'}",
        f"--data={tiny.data_dir}",
        f"--state={run_dir / 'state'}",
        f"--checkpoint={run_dir / 'final.pt'}",
        f"--metrics={run_dir / 'metrics.jsonl'}",
    )


@pytest.mark.parametrize("name", sorted(presets.PRESETS))
def test_every_preset_sets_every_recipe_key(name: str) -> None:
    assert set(presets.PRESETS[name]) == set(presets.RECIPE_KEYS)


def test_fast_preset_is_the_default_and_divides_by_common_world_sizes() -> None:
    train = config.resolve(default_config())["train"]
    assert train["preset"] == "fast"
    for world_size in (1, 2, 4, 8):
        assert train["batch_size"] % world_size == 0


def test_reference_preset_is_the_classic_recipe() -> None:
    cfg = default_config()
    cfg["train"]["preset"] = "reference"
    train = config.resolve(cfg)["train"]
    assert (train["optimizer"], train["lr"], train["schedule"], train["gamma"]) == (
        "adadelta",
        1.0,
        "step",
        0.7,
    )
    assert (train["epochs"], train["batch_size"], train["precision"]) == (14, 128, "fp32")


@pytest.mark.parametrize("preset", ["fast", "reference"])
def test_preset_trains_one_epoch_with_two_processes(
    preset: str, tiny: TinyData, tmp_path: Path
) -> None:
    """Each preset's own recipe (batch, optimizer, schedule, precision), one epoch on tiny data."""
    cfg = tiny_config(tiny, preset=preset, epochs=1, batch_size=None)
    launch(cfg, tiny, tmp_path)
    (line,) = (tmp_path / "metrics.jsonl").read_text().splitlines()
    metrics = json.loads(line)
    assert metrics["epoch"] == 1 and metrics["world_size"] == 2
    assert metrics["images_per_s"] > 0 and 0 <= metrics["test_accuracy"] <= 1
    assert math.isfinite(metrics["train_loss"]) and math.isfinite(metrics["test_loss"])
    resolved = config.load(tmp_path / "config.yaml")["train"]
    assert resolved["precision"] == presets.PRESETS[preset]["precision"]
