"""Running inside the image: the image a run uses, and the ``apptainer exec`` prefix."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from ddppipe.apptainer.binds import bind_args, user_binds
from ddppipe.apptainer.requirements import layer_path, requirements
from ddppipe.apptainer.tool import APPTAINER, enabled
from ddppipe.settings.run_spec import Container, RunSpec

IMAGE_PYTHON = "python"  # the image's venv python, first on its PATH
TASK_SITE = "/opt/task-site"  # where a task's layer (container.requirements) is bound


def gpus_present() -> bool:
    """Whether this host has NVIDIA GPUs that ``apptainer exec --nv`` could bind in."""
    return Path("/dev/nvidiactl").exists() or shutil.which("nvidia-smi") is not None


def run_image(container: Container) -> str:
    """The image train and evaluate run in: container.image (a task's packages are a layer
    over it: :func:`task_layer`)."""
    return str(container.image)


def task_layer(container: Container) -> Path | None:
    """The SquashFS layer of container.requirements beside the image (rule build_task_layer,
    :func:`~ddppipe.apptainer.requirements.layer_path`); None without requirements."""
    reqs = requirements(container)
    return layer_path(container.image, reqs) if reqs else None


def layer_args(container: Container) -> list[str]:
    """The ``apptainer exec`` options binding the task's layer read-only at :data:`TASK_SITE`
    first on Python's path, the user's site (``~/.local``) off so it cannot shadow it; none
    without requirements."""
    layer = task_layer(container)
    if layer is None:
        return []
    return [*bind_args(layer, TASK_SITE, ("ro", "image-src=/")), "--env",
            f"PYTHONPATH={TASK_SITE}", "--env", "PYTHONNOUSERSITE=1"]  # fmt: skip


def exec_prefix(spec: RunSpec, data_binds: tuple[str, ...] = ()) -> list[str]:
    """``apptainer exec [--nv] [exec_args] [--bind DIR ...] [LAYER] IMAGE``, or ``[]`` when off.

    ``--nv`` is added when the run trains on GPUs (its spec's device); the binds are
    :func:`~ddppipe.apptainer.binds.user_binds`, then ``data_binds`` (a packed data folder's
    image: :meth:`ddppipe.data.squashfs.Image.bind`); LAYER is :func:`layer_args`; IMAGE is
    :func:`run_image`.
    """
    if not enabled(spec.container):
        return []
    extra = list(spec.container.exec_args)
    nv = ["--nv"] if spec.gpus and "--nv" not in extra else []
    binds = [arg for bind in [*user_binds(spec), *data_binds] for arg in ("--bind", bind)]
    layer = layer_args(spec.container)
    return [APPTAINER, "exec", *nv, *extra, *binds, *layer, run_image(spec.container)]


def python_command(spec: RunSpec, data_binds: tuple[str, ...] = ()) -> list[str]:
    """The Python to start training with: this interpreter, or the image's via exec_prefix."""
    prefix = exec_prefix(spec, data_binds)
    return [*prefix, IMAGE_PYTHON] if prefix else [sys.executable]
