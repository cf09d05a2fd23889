"""The software stack of this process: ddppipe, torch, CUDA, cuDNN, NCCL, Python, every
installed distribution, the OS, the CPU and GPUs."""

from __future__ import annotations

import importlib.metadata
import platform
from typing import Any

from ddppipe import __version__
from ddppipe.core import system
from ddppipe.parallel import devices


def packages() -> dict[str, str]:
    """Every distribution installed where this process runs (the venv's, or the image's), by
    lower-case name: what a rebuild of the environment must install."""
    found = {(d.metadata["Name"] or "").lower(): d.version
             for d in importlib.metadata.distributions()}  # fmt: skip
    found.pop("", None)
    return dict(sorted(found.items()))


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


def stack() -> dict[str, Any]:
    """The stack of this process: versions, the OS and CPU, the GPUs and driver when there
    are some, and every installed distribution.

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
        "os": platform.platform(),
        "cpu": system.cpu_model(),
        **devices.info(),
        "packages": packages(),
    }
