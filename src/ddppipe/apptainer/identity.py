"""An image's identity: its SHA-256, its labels, and the info JSON written next to it."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from pathlib import Path

from ddppipe.apptainer.tool import APPTAINER, ContainerError
from ddppipe.core import hashing


def info_path(image: str | Path) -> Path:
    """The image-info JSON written next to an image: ``X.sif`` -> ``X.json``."""
    return Path(image).with_suffix(".json")


def sha256(path: str | Path) -> str:
    """An image's (or recipe's) SHA-256."""
    return hashing.file_sha256(path)


def labels(image: str | Path) -> dict[str, str]:
    """The image's labels, from ``apptainer inspect --json --labels``."""
    cmd = [APPTAINER, "inspect", "--json", "--labels", str(image)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=120).stdout
    except (OSError, subprocess.SubprocessError) as e:
        stderr = getattr(e, "stderr", "") or ""
        raise ContainerError(f"`{' '.join(cmd)}` failed: {e}\n{stderr}") from e
    return json.loads(out)["data"]["attributes"]["labels"]


PACKAGES = "ddppipe.packages"  # every distribution in the image's venv: `name==version ...`
LAYER = "layer"  # a container record's task layer (container.requirements), beside the image's


def packages(labels: dict[str, str], added: Sequence[str] = ()) -> dict[str, str] | None:
    """The distributions an image's labels record, by lower-case name (as
    :func:`ddppipe.parallel.software.packages` names them), with ``added`` (a task's layer's
    ``installed``: ``name==version``) over them; None: an image built before ddppipe recorded
    them."""
    if PACKAGES not in labels:
        return None
    found: dict[str, str] = {}
    for pin in [*(labels.get(PACKAGES) or "").split(), *added]:
        name, _, version = pin.partition("==")
        found[name.lower()] = version
    return dict(sorted(found.items()))


def image_info(image: str | Path, recipe: str | Path, path: str | Path | None = None) -> dict:
    """What the provenance records of an image: its path, SHA-256, recipe and labels."""
    return {
        "path": str(path or image),
        "sha256": sha256(image),
        "size_bytes": Path(image).stat().st_size,
        "recipe": str(recipe),
        "recipe_sha256": sha256(recipe),
        "labels": labels(image),
    }


def layer_problem(image: dict, layer: dict) -> str | None:
    """Why the task layer ``layer`` (its info) does not serve over the image ``image`` (its
    info): built over an image with another SHA-256; None when it does."""
    if layer["base"]["sha256"] == image["sha256"]:
        return None
    return (
        f"the task layer {layer['path']} was built over an image with SHA-256 "
        f"{layer['base']['sha256'][:12]}, not {image['path']} ({image['sha256'][:12]}): the "
        "image was rebuilt or replaced since; run the workflow again (rule build_task_layer "
        "builds the layer over it)"
    )


def container_record(image: dict, layer: dict | None) -> dict:
    """What the provenance records of the container a run trained in: the image's info, with
    its task layer's (``layer``: rule build_task_layer's info) under :data:`LAYER`.
    ContainerError when the layer was built over another image than this one."""
    if layer is None:
        return image
    problem = layer_problem(image, layer)
    if problem:
        raise ContainerError(problem)
    return {**image, LAYER: layer}
