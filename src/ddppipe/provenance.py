"""Provenance of a trained model: code, software, hardware, data and config."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path
from typing import Any

from ddppipe import __version__, devices, manifest


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
    """NCCL of this torch build ("2.30.7"); it answers without a GPU. None: no NCCL."""
    import torch

    if not torch.version.cuda or not torch.distributed.is_nccl_available():
        return None
    try:
        version = torch.cuda.nccl.version()
    except (RuntimeError, AttributeError):
        return None
    return ".".join(str(v) for v in version) if isinstance(version, tuple) else str(version)


def cudnn_version() -> str | None:
    """cuDNN of this torch build ("9.24.0"); None without one."""
    import torch

    number = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if not number:
        return None
    major, rest = divmod(number, 10000) if number >= 10000 else divmod(number, 1000)
    minor, patch = divmod(rest, 100)
    return f"{major}.{minor}.{patch}"


def software() -> dict[str, Any]:
    """The stack of this process: versions, and the GPUs and driver when there are some.

    (It imports torch: a task's provenance takes the stack rank 0 recorded, so the export
    rule does not.)"""
    import torch

    return {
        "ddppipe": __version__,
        "torch": str(torch.__version__),
        "cuda": torch.version.cuda,
        "cudnn": cudnn_version(),
        "nccl": nccl_version(),
        "python": platform.python_version(),
        **devices.info(),
    }


def data_checksums(data_dir: Path) -> dict[str, str]:
    """SHA-256 of every file the task prepared (from its checked manifest)."""
    return {rel: f["sha256"] for rel, f in manifest.check(data_dir)["files"].items()}


def record(
    final: dict[str, Any],
    data_dir: Path,
    image: dict[str, Any] | None = None,
    attempts: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The provenance of a final training snapshot (``final``: its epochs, config hash and
    meta, :func:`ddppipe.checkpoint.record`)."""
    meta = final["meta"]
    return {
        "git": git_commit(),
        # the stack that trained (recorded by rank 0), not the one that exports
        "software": meta.get("software") or software(),
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
        "epochs": final["epoch"],
        "config_hash": final["config_hash"],
        "train_config": meta["train"],
        "task": meta.get("task"),  # file, SHA-256, version of the task that trained
        "task_args": meta.get("task_args"),
        "data_sha256": data_checksums(data_dir),
        "container": image,
        "attempts": attempts,
    }


SNAKEMAKE_MARK = ".snakemake_timestamp"  # Snakemake's file in a directory() output: not the run's


def script_record(
    cfg: dict[str, Any],
    outputs: Path,
    image: dict[str, Any] | None = None,
    attempts: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The provenance of a script run: the script (file, SHA-256, arguments), its outputs."""
    from ddppipe import config, hashing

    files = sorted(p for p in Path(outputs).rglob("*")
                   if p.is_file() and p.name != SNAKEMAKE_MARK)  # fmt: skip
    return {
        "git": git_commit(),
        "software": software(),  # the launcher's stack; the script's own may differ
        "script": {**cfg["task_source"], "args": cfg["script_args"]},
        "world_size": config.world_size(cfg),
        "outputs_sha256": {str(p.relative_to(outputs)): hashing.file_sha256(p) for p in files},
        "container": image,
        "attempts": attempts,
    }
