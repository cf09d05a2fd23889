"""Running inside the image: the image a run uses, and the ``apptainer exec`` prefix."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from ddppipe.apptainer.binds import user_binds
from ddppipe.apptainer.requirements import derived_image, requirements
from ddppipe.apptainer.tool import APPTAINER, enabled
from ddppipe.settings.run_spec import Container, RunSpec

IMAGE_PYTHON = "python"  # the image's venv python, first on its PATH


def gpus_present() -> bool:
    """Whether this host has NVIDIA GPUs that ``apptainer exec --nv`` could bind in."""
    return Path("/dev/nvidiactl").exists() or shutil.which("nvidia-smi") is not None


def run_image(container: Container) -> str:
    """The image train and evaluate run in: container.image, or with container.requirements
    the image derived from it (:func:`~ddppipe.apptainer.requirements.derived_image`, rule
    build_task_image)."""
    base = str(container.image)
    reqs = requirements(container)
    return str(derived_image(base, reqs)) if reqs else base


def exec_prefix(spec: RunSpec, data_binds: tuple[str, ...] = ()) -> list[str]:
    """``apptainer exec [--nv] [exec_args] [--bind DIR ...] IMAGE``, or ``[]`` when off.

    ``--nv`` is added when the run trains on GPUs (its spec's device); the binds are
    :func:`~ddppipe.apptainer.binds.user_binds`, then ``data_binds`` (a packed data folder's
    image: :meth:`ddppipe.data.squashfs.Image.bind`); IMAGE is :func:`run_image`.
    """
    if not enabled(spec.container):
        return []
    extra = list(spec.container.exec_args)
    nv = ["--nv"] if spec.gpus and "--nv" not in extra else []
    binds = [arg for bind in [*user_binds(spec), *data_binds] for arg in ("--bind", bind)]
    return [APPTAINER, "exec", *nv, *extra, *binds, run_image(spec.container)]


def python_command(spec: RunSpec, data_binds: tuple[str, ...] = ()) -> list[str]:
    """The Python to start training with: this interpreter, or the image's via exec_prefix."""
    prefix = exec_prefix(spec, data_binds)
    return [*prefix, IMAGE_PYTHON] if prefix else [sys.executable]
