"""Tiny generated MNIST-like IDX data, configs and task files for fast tests."""

from __future__ import annotations

import copy
import gzip
import hashlib
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from ddppipe.data import idx, manifest, mnist_files

REPO = Path(__file__).resolve().parents[1]
REAL_MNIST = REPO.parent / "shared" / "data" / "mnist"


@dataclass(frozen=True)
class TinyData:
    data_dir: Path  # decompressed IDX files, as the download rule leaves them
    mirror: Path  # <name>.gz files, as a mirror serves them
    sha256: dict[str, str]

    @property
    def mirror_url(self) -> str:
        return self.mirror.as_uri() + "/"


def make_split(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Images whose mean brightness encodes the label, so a model can learn something."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g, dtype=torch.uint8)
    noise = torch.randint(0, 40, (n, 28, 28), generator=g)
    images = (noise + labels.long().view(-1, 1, 1) * 20).clamp(max=255).to(torch.uint8)
    return images, labels


def make_tiny(root: Path, n_train: int = 256, n_test: int = 128) -> TinyData:
    """Write a tiny dataset and a gzip mirror of it below ``root``."""
    data_dir, mirror = root / "data", root / "mirror"
    data_dir.mkdir(parents=True, exist_ok=True)
    mirror.mkdir(parents=True, exist_ok=True)
    train_x, train_y = make_split(n_train, 1)
    test_x, test_y = make_split(n_test, 2)
    tensors = {
        mnist_files.TRAIN_IMAGES: train_x,
        mnist_files.TRAIN_LABELS: train_y,
        mnist_files.TEST_IMAGES: test_x,
        mnist_files.TEST_LABELS: test_y,
    }
    sha = {}
    for name, tensor in tensors.items():
        content = idx.encode(tensor)
        (data_dir / name).write_bytes(content)
        (mirror / f"{name}.gz").write_bytes(gzip.compress(content, mtime=0))
        sha[name] = hashlib.sha256(content).hexdigest()
    manifest.write(data_dir, {"ref": "ddppipe.tasks.mnist"}, {"sha256": sha})
    return TinyData(data_dir, mirror, sha)


def fast_cpu_precision() -> str:
    """The fast preset's precision on this machine's CPUs: bf16 where ``lscpu`` lists a native
    bfloat16 multiply (AVX512-BF16, AMX-BF16, Arm BF16), else fp32."""
    flags = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    return "bf16" if re.search(r"\b(avx512_bf16|amx_bf16|bf16)\b", flags) else "fp32"


def default_config() -> dict[str, Any]:
    return yaml.safe_load((REPO / "config" / "config.yaml").read_text())


def tiny_config(data: TinyData, **train: Any) -> dict[str, Any]:
    """The default config pointed at a tiny mirror, trained briefly."""
    cfg = copy.deepcopy(default_config())
    cfg["run"] = "tiny"
    cfg["task_args"] = {"mirrors": [data.mirror_url], "sha256": data.sha256, "timeout_s": 10}
    cfg["train"].update({"epochs": 1, "batch_size": 32, "eval_batch_size": 64})
    cfg["train"].update(train)
    return cfg


def real_mnist_sha256() -> dict[str, str]:
    sums = {}
    for line in (REAL_MNIST / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split()
        sums[name] = digest
    return sums


def points_task(*, dim: int, hidden: int, noise: float, hold_after: int = 0) -> str:
    """A user's own task file, as text (a test writes it beside its config as ``points.py``):
    4 classes of noisy points in ``dim`` dimensions (``task_args``: ``samples`` of them, the last
    fifth the test set; standard deviation ``noise`` about each class's centre), an MLP of
    ``hidden`` units. Its first layer holds the training: once a rank has run more than
    ``hold_after`` forwards in training mode, each forward waits while the file ``hold`` beside
    the task exists, saying so in ``held-<rank>`` there."""
    return f'''\
"""Noisy points in {dim} dimensions, 4 classes; a small MLP learns them."""

import os
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

DIM, HIDDEN, CLASSES = {dim}, {hidden}, 4
HERE = Path(__file__).parent


class Held(nn.Module):
    calls = 0

    def forward(self, x):
        if self.training:
            Held.calls += 1
        if Held.calls > {hold_after} and (HERE / "hold").exists():
            (HERE / f"held-{{os.environ['RANK']}}").touch()
            while (HERE / "hold").exists():
                time.sleep(0.1)
        return x


def prepare(data_dir: Path, args: dict) -> None:
    data_dir = Path(data_dir)
    if (data_dir / "points.npz").exists():
        return
    rng = np.random.default_rng(7)
    centres = rng.normal(0, 1, (CLASSES, DIM))
    labels = rng.integers(0, CLASSES, args["samples"])
    points = centres[labels] + rng.normal(0, {noise}, (args["samples"], DIM))
    data_dir.mkdir(parents=True, exist_ok=True)
    np.savez(data_dir / "points.tmp.npz", x=points.astype(np.float32), y=labels)
    os.replace(data_dir / "points.tmp.npz", data_dir / "points.npz")


def datasets(data_dir: Path, args: dict):
    data = np.load(Path(data_dir) / "points.npz")
    x, y = torch.from_numpy(data["x"]), torch.from_numpy(data["y"])
    cut = len(x) * 4 // 5
    return TensorDataset(x[:cut], y[:cut]), TensorDataset(x[cut:], y[cut:])


def model(args: dict) -> nn.Module:
    return nn.Sequential(Held(), nn.Linear(DIM, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))
'''
