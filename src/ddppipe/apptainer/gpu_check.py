"""GPU runs need a CUDA image: the check that a GPU run's image has one, once per device decision
and container section."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddppipe.apptainer.identity import info_path, sha256
from ddppipe.apptainer.tool import ContainerError, enabled
from ddppipe.settings.run_spec import RunSpec


def recipe_labels(recipe: str | Path) -> dict[str, str]:
    """The static ``%labels`` of a recipe (``name value`` lines)."""
    found: dict[str, str] = {}
    section = ""
    for line in Path(recipe).read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("%"):
            section = stripped.split()[0]
        elif section == "%labels" and stripped and not stripped.startswith("#"):
            name, _, value = stripped.partition(" ")
            found[name] = value.strip()
    return found


def cpu_only(recipe: Path, info: Path) -> str | None:
    """Why the image (built, or else to be built from ``recipe``) has no CUDA; None if it has.

    A built image answers with its labels (``ddppipe.cuda.version``, written at build time),
    if it was built from this recipe; a recipe not built yet with its ``ddppipe.variant``.
    """
    if info.is_file() and recipe.is_file():
        built = json.loads(info.read_text())
        if built.get("recipe_sha256") == sha256(recipe):
            labels = built.get("labels", {})
            if labels.get("ddppipe.cuda.version") in (None, "", "None"):
                torch = labels.get("ddppipe.torch.version", "?")
                return f"the image {built.get('path')} has a CPU-only torch ({torch})"
            return None
    if recipe.is_file():
        variant = recipe_labels(recipe).get("ddppipe.variant", "")
        if "cpu" in variant.lower():
            return f"the recipe {recipe} builds a CPU-only image (ddppipe.variant {variant})"
    return None


def check_gpu_image(spec: RunSpec, recipe: str | Path, image: str | Path) -> None:
    """Raise ContainerError when a GPU run (its spec's device) would train in an image without
    CUDA."""
    if not enabled(spec.container) or not spec.gpus:
        return
    reason = cpu_only(Path(recipe), info_path(image))
    if reason:
        raise ContainerError(
            f"GPUs are requested (launch.device: {spec.launch.device}) but {reason}: every "
            "rank would stop. "
            "Set container.recipe: containers/ddppipe.def (CUDA + NCCL), or train on CPUs "
            "(launch.device: cpu)"
        )


@dataclass
class GpuImageCheck:
    """:func:`check_gpu_image` once per what it depends on (the recipe, the device decision,
    ``launch.device`` and the container section): a sweep's trials share one check."""

    done: set[tuple[Any, ...]] = field(default_factory=set)

    def __call__(self, spec: RunSpec, recipe: str | Path) -> None:
        """Raise ContainerError as :func:`check_gpu_image` (a failed check is not kept)."""
        key = (str(recipe), spec.gpus, spec.launch.device, spec.container)
        if key not in self.done:
            check_gpu_image(spec, recipe, spec.container.image)
            self.done.add(key)
