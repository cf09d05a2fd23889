"""Provenance of a trained model: code, software, hardware, data and config."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

from ddppipe import __version__, download, mnist


def git_commit(cwd: Path | None = None) -> dict[str, Any]:
    """HEAD's commit and whether the work tree has uncommitted changes (None outside git)."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=cwd, capture_output=True, text=True, check=True, timeout=30
        ).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain"))}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def nccl_version() -> str | None:
    if not torch.cuda.is_available() or not torch.distributed.is_nccl_available():
        return None
    return ".".join(str(v) for v in torch.cuda.nccl.version())


def software() -> dict[str, Any]:
    return {
        "ddppipe": __version__,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl_version(),
        "python": platform.python_version(),
    }


def data_checksums(data_dir: Path) -> dict[str, str]:
    return {name: download.file_sha256(data_dir / name) for name in mnist.FILES}


def record(
    snapshot: dict[str, Any],
    data_dir: Path,
    image: dict[str, Any] | None = None,
    attempts: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The provenance of a final training snapshot."""
    meta = snapshot["meta"]
    return {
        "git": git_commit(),
        "software": software(),
        "training": {
            "world_size": meta["world_size"],
            "hosts": sorted(set(meta["hosts"])),
            "rank_hosts": meta["hosts"],
            "backend": meta["backend"],
            "launcher": meta["launcher"],
            "device": meta["device"],
            "device_name": meta["device_name"],
            "torch": meta["torch"],
            "ddppipe": meta["ddppipe"],
        },
        "seed": meta["seed"],
        "epochs": snapshot["epoch"],
        "config_hash": snapshot["config_hash"],
        "train_config": meta["train"],
        "data_sha256": data_checksums(data_dir),
        "container": image,
        "attempts": attempts,
    }
