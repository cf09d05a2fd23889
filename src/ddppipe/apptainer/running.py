"""Running inside the image: the image a run uses, and the ``apptainer exec`` prefix."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from ddppipe.apptainer import identity
from ddppipe.apptainer.binds import bind_args, user_binds
from ddppipe.apptainer.requirements import layer_path, requirements
from ddppipe.apptainer.tool import APPTAINER, ContainerError, enabled
from ddppipe.data import manifest, squashfs
from ddppipe.runstate import node_beats
from ddppipe.settings import run_spec
from ddppipe.settings.run_spec import Container, RunSpec

IMAGE_PYTHON = "python"  # the image's venv python, first on its PATH
TASK_SITE = "/opt/task-site"  # where a task's layer (container.requirements) is bound
CONTAINED = {"--contain", "-c", "--containall", "-C", "--no-mount"}  # a private /dev and /tmp


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
    return [] if layer is None else layer_bound(layer)


def layer_bound(layer: str | Path) -> list[str]:
    """The ``apptainer exec`` options binding the SquashFS file ``layer`` as the task's layer
    (:func:`layer_args`; the layer's own check before it is used)."""
    return [*bind_args(layer, TASK_SITE, ("ro", "image-src=/")), "--env",
            f"PYTHONPATH={TASK_SITE}", "--env", "PYTHONNOUSERSITE=1"]  # fmt: skip


def exec_prefix(spec: RunSpec, data: Path | None = None) -> list[str]:
    """``apptainer exec [--nv] [exec_args] [--bind DIR ...] [LAYER] IMAGE``, or ``[]`` when off.

    ``--nv`` is added when the run trains on GPUs (its spec's device); the binds are
    :func:`~ddppipe.apptainer.binds.user_binds`, then the data folder ``data``'s packed image
    (:func:`data_binds`), then, where
    ``exec_args`` contain the container (:data:`CONTAINED`: its own ``/dev`` and ``/tmp``), the
    folder of the ranks' node-local heartbeats (:func:`ddppipe.runstate.node_beats.local_base`,
    which a local launcher reads from outside); LAYER is
    :func:`layer_args`; IMAGE is :func:`run_image`.
    """
    if not enabled(spec.container):
        return []
    extra = list(spec.container.exec_args)
    nv = ["--nv"] if spec.gpus and "--nv" not in extra else []
    binds = [arg for folder in user_binds(spec) for arg in bind_args(folder)]
    binds += data_binds(spec, data)
    if CONTAINED & set(extra) and node_beats.private_base():  # (the launcher reads them)
        binds += bind_args(str(node_beats.local_base()))
    layer = layer_args(spec.container)
    return [APPTAINER, "exec", *nv, *extra, *binds, *layer, run_image(spec.container)]


def check_layer(container: Container) -> None:
    """ContainerError when the task's layer was built over another image than the one beside
    it now (their info JSONs: :func:`~ddppipe.apptainer.identity.layer_problem`): its
    packages were resolved against another image's, and could shadow this one's. Nothing to
    check without a layer, or before their info is written."""
    layer = task_layer(container)
    if layer is None:
        return
    found = [identity.info_path(p) for p in (container.image, layer)]
    if all(p.is_file() for p in found):
        image, built = (json.loads(p.read_text()) for p in found)
        problem = identity.layer_problem(image, built)
        if problem:
            raise ContainerError(problem)


def data_binds(spec: RunSpec, data: Path | None) -> list[str]:
    """The options binding the data folder ``data``'s SquashFS image over the task's folder
    (``--bind IMAGE:FOLDER:image-src=/``; ``data.pack: squashfs``,
    :mod:`ddppipe.data.squashfs`); none without an image (a process outside a container mounts
    the image itself)."""
    image = None if data is None else squashfs.Image.of(data, manifest.read(data))
    if image is None:
        return []
    source, folder = image.bind(run_spec.plain(spec.task_args))
    return bind_args(source, folder, ("image-src=/",))


def python_command(spec: RunSpec, data: Path | None = None) -> list[str]:
    """The Python every process of the run starts: this interpreter, or the image's via
    exec_prefix (its task layer checked first: :func:`check_layer`), ``data``'s image bound
    in. Decided once a launcher, at its start: the same for every slot and step of it."""
    prefix = exec_prefix(spec, data)
    if prefix:
        check_layer(spec.container)
    return [*prefix, IMAGE_PYTHON] if prefix else [sys.executable]
