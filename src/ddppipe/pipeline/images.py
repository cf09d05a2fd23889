"""The Apptainer image in the workflow (``container:``): what rule build_image reads, the image
a run trains in, and the prefix of the rules that run inside it."""

from __future__ import annotations

import glob
import os
import shlex
from dataclasses import dataclass
from typing import Any

from snakemake.exceptions import WorkflowError

from ddppipe.apptainer import identity, requirements, running
from ddppipe.apptainer import tool as apptainer
from ddppipe.settings.run_spec import RunSpec
from ddppipe.settings.runs import Runs


@dataclass(frozen=True)
class Images:
    """The image of the base run ``run`` of ``runs`` (a sweep's trials share its
    ``container:``), built from ``recipe`` (container.recipe) in ``root``, the repository (the
    recipes' ``%files`` paths are relative to it); ``script``: a script run (it imports no
    task)."""

    runs: Runs
    run: str
    recipe_file: str
    root: str
    script: bool

    @property
    def spec(self) -> RunSpec:
        """The base run's spec (resolved once, on first use: its device needs the recipe)."""
        return self.runs.spec(self.run)

    @property
    def enabled(self) -> bool:
        return apptainer.enabled(self.spec.container)

    def recipe(self) -> str:
        """The image's recipe (container.recipe), from the repository's root."""
        return os.path.join(self.root, self.recipe_file)

    def sources(self) -> dict[str, Any]:
        """What the image is built from: recipe, pyproject.toml, the torch pin, the sources."""
        src = os.path.join(self.root, "src", "ddppipe")
        found = glob.glob(f"{src}/**/*.py", recursive=True)
        found += glob.glob(f"{src}/**/*.yaml", recursive=True)
        return {
            "recipe": self.recipe(),
            "pyproject": os.path.join(self.root, "pyproject.toml"),
            "constraints": os.path.join(self.root, "constraints.txt"),
            "sources": sorted(found),
        }

    def requirements(self) -> list[str]:
        """container.requirements (sorted); an unpinned one is a config error. Non-empty:
        rule build_task_layer installs them over container.image into a SquashFS layer."""
        try:
            return requirements.requirements(self.spec.container)
        except apptainer.ContainerError as e:
            raise WorkflowError(str(e)) from None

    def run_image(self) -> str:
        """The image train and evaluate run in: container.image."""
        return str(running.run_image(self.spec.container))

    def task_layer(self) -> str | None:
        """The task's layer (container.requirements) bound over the image; None without
        requirements."""
        layer = running.task_layer(self.spec.container)
        return None if layer is None else str(layer)

    def info(self, image: str) -> str:
        """The info JSON beside ``image`` (or a layer)."""
        return str(identity.info_path(image))

    def as_input(self) -> list[str]:
        """The image and its task layer (and their info) as inputs of the rules that run in
        them (train, and with :meth:`task_exec` prepare_data and write_config): built first;
        none when mode is none."""
        if not self.enabled:
            return []
        layer = self.task_layer()
        files = [self.run_image(), *([layer] if layer else [])]
        return [f for path in files for f in (path, self.info(path))]

    def task_input(self) -> list[str]:
        """:meth:`as_input` of a rule that imports the task: none in a script run."""
        return [] if self.script else self.as_input()

    def exec_prefix(self) -> str:
        """Shell prefix running a rule's command inside the image ('' when mode is none)."""
        return shlex.join(running.exec_prefix(self.spec)) + " " if self.enabled else ""

    def task_exec(self) -> str:
        """Shell prefix of a rule that imports the task (its prepare(), the check of task_args
        and model()): with container.mode apptainer, `apptainer exec ... IMAGE ` of the image
        (and task layer) the run trains in, so the host needs none of the task's packages; ''
        without a container, and in a script run (write_config only hashes a script). Part
        of the rule's text, so a run without a container keeps its commands, and re-runs
        nothing."""
        if self.script:
            return ""
        return self.exec_prefix().replace("{", "{{").replace("}", "}}")

    def info_arg(self) -> str:
        """`ddppipe export`'s options recording the image (and task layer) training ran in
        in the provenance."""
        if not self.enabled:
            return ""
        layer = self.task_layer()
        found = f" --layer-info {self.info(layer)}" if layer else ""
        return f"--image-info {self.info(self.run_image())}{found}"
