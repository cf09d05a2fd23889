"""Building a task image: the base image plus ``container.requirements``, and its info."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ddppipe.apptainer.building import build
from ddppipe.apptainer.identity import image_info, info_path, sha256
from ddppipe.apptainer.requirements import pinned, recipe_path
from ddppipe.apptainer.task_recipe import derived_recipe
from ddppipe.apptainer.tool import ContainerError
from ddppipe.core import atomic


def build_task_image(
    base: str | Path, reqs: list[str], image: str | Path, log: str | Path, timeout_s: float = 3600
) -> dict[str, Any]:
    """Build ``image`` = ``base`` + the pinned ``reqs`` atomically (``building.build``); its info.

    The recipe is written next to ``image`` (``.def``). The info is ``identity.image_info`` plus
    the requirements and the base image's path, SHA-256 and recipe (from its info JSON).
    """
    reqs = pinned(reqs)
    if not reqs:
        raise ContainerError("no requirements to add: train in the base image itself")
    base, image = Path(base), Path(image)
    if not base.is_file():
        raise ContainerError(f"base image {base} not found: build it first (rule build_image)")
    found = info_path(base)
    base_info = json.loads(found.read_text()) if found.is_file() else {"sha256": sha256(base)}
    recipe = recipe_path(image)
    recipe.parent.mkdir(parents=True, exist_ok=True)
    relative = os.path.relpath(base.resolve(), recipe.parent.resolve())
    atomic.write_text(recipe, derived_recipe(relative, reqs, base_info.get("sha256")))
    build(recipe, image, log, context=recipe.parent, timeout_s=timeout_s, arguments=[])
    keys = ("sha256", "recipe", "recipe_sha256")
    return {
        **image_info(image, recipe),
        "requirements": reqs,
        "base": {"path": str(base), **{k: base_info.get(k) for k in keys}},
    }
