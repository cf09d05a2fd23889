"""The image subcommands: build an image or a task's layer, describe one (the image rules)."""

from __future__ import annotations

from pathlib import Path

from ddppipe.apptainer import building, identity
from ddppipe.apptainer.layer import build_layer
from ddppipe.core import atomic


def build_image(recipe: Path, image: Path, info: Path, log: Path, context: Path | None) -> int:
    """``ddppipe build-image``: build ``image`` from ``recipe`` in ``context`` (default: the
    current folder), then write its ``info`` JSON."""
    building.build(recipe, image, log, Path.cwd() if context is None else context)
    atomic.write_json(info, identity.image_info(image, recipe))
    return 0


def build_task_layer(
    base: Path, requirements: list[str], layer: Path, info: Path, log: Path
) -> int:
    """``ddppipe build-task-layer``: the pinned ``requirements`` over ``base`` as a SquashFS
    layer, and its info."""
    atomic.write_json(info, build_layer(base, requirements, layer, log))
    return 0


def image_info(image: Path, recipe: Path, out: Path) -> int:
    """``ddppipe image-info``: write the info JSON (SHA-256, labels) of a built image."""
    atomic.write_json(out, identity.image_info(image, recipe))
    return 0
