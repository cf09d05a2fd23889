"""Running inside the image: the image a run uses, and the ``apptainer exec`` prefix."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

from ddppipe.apptainer.binds import user_binds
from ddppipe.apptainer.requirements import derived_image, requirements
from ddppipe.apptainer.tool import APPTAINER, enabled

IMAGE_PYTHON = "python"  # the image's venv python, first on its PATH


def gpus_present() -> bool:
    """Whether this host has NVIDIA GPUs that ``apptainer exec --nv`` could bind in."""
    return Path("/dev/nvidiactl").exists() or shutil.which("nvidia-smi") is not None


def run_image(cfg: dict[str, Any]) -> str:
    """The image train and evaluate run in: container.image, or with container.requirements
    the image derived from it (:func:`~ddppipe.apptainer.requirements.derived_image`, rule
    build_task_image)."""
    base = str(cfg["container"]["image"])
    reqs = requirements(cfg)
    return str(derived_image(base, reqs)) if reqs else base


def exec_prefix(cfg: dict[str, Any], gpus: bool) -> list[str]:
    """``apptainer exec [--nv] [exec_args] [--bind DIR ...] IMAGE``, or ``[]`` when off.

    ``--nv`` is added when ``gpus`` (the run's device is a GPU); the binds are
    :func:`~ddppipe.apptainer.binds.user_binds`; IMAGE is :func:`run_image`.
    """
    if not enabled(cfg):
        return []
    extra = list(cfg["container"]["exec_args"])
    nv = ["--nv"] if gpus and "--nv" not in extra else []
    binds = [arg for folder in user_binds(cfg) for arg in ("--bind", folder)]
    return [APPTAINER, "exec", *nv, *extra, *binds, run_image(cfg)]


def python_command(cfg: dict[str, Any], gpus: bool) -> list[str]:
    """The Python to start training with: this interpreter, or the image's via exec_prefix."""
    prefix = exec_prefix(cfg, gpus)
    return [*prefix, IMAGE_PYTHON] if prefix else [sys.executable]
