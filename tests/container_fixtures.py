"""The container tests' shared pieces (tests/test_container.py, tests/test_task_layer.py): a
config's container settings, the image the local DAG builds once a session, its working
directory taken in turns, and dry runs there.

``image_run`` and ``image_workdir`` are fixtures: ``conftest.py`` imports them, so the image is
built once for every file that uses it; a test module of the image is marked ``IMAGE_TESTS``.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ddppipe.settings import config, run_spec
from tests import across_workers
from tests.tiny import REPO, TinyData, default_config, tiny_config
from tests.workflow_helpers import snakemake

IMAGE = "results/images/ddppipe.sif"
# The marks of a test module of the image: Apptainer (so slow); the session fixture builds the
# image (about 6 min on 2 cores), counted in the first test's time; each test alone in its
# working directory (which also groups them under pytest-xdist: tests/conftest.py).
IMAGE_TESTS = [
    pytest.mark.apptainer,
    pytest.mark.timeout(2700),
    pytest.mark.usefixtures("image_workdir"),
]


def require_apptainer() -> None:
    if shutil.which("apptainer") is None:  # CI installs it (make system-deps): never skip
        pytest.fail("apptainer is not installed: run `bash .ci/install_apptainer.sh` (root)")


@dataclass(frozen=True)
class ImageRun:
    workdir: Path
    cfg: dict[str, Any]
    recipe: Path  # a copy of the recipe (tests touch it)
    seconds: float  # build + the whole DAG

    @property
    def image(self) -> Path:
        return self.workdir / IMAGE


@pytest.fixture(scope="session")
def image_run(tmp_path_factory: pytest.TempPathFactory, tiny: TinyData) -> ImageRun:
    """The local DAG, image build included, run end to end through the image (once, by the
    first of the test workers that needs it: tests/across_workers.py)."""
    require_apptainer()

    def build(root: Path) -> dict[str, Any]:
        recipe = root / "recipe" / "ddppipe.def"
        recipe.parent.mkdir()
        shutil.copy2(REPO / "containers" / "ddppipe.def", recipe)
        cfg = tiny_config(tiny)
        cfg["container"] = {"mode": "apptainer", "recipe": str(recipe), "image": IMAGE,
                            "exec_args": []}  # fmt: skip
        start = time.monotonic()
        snakemake(root / "work", cfg, "--cores", "2", timeout=2400)
        return {"workdir": str(root / "work"), "cfg": cfg, "recipe": str(recipe),
                "seconds": time.monotonic() - start}  # fmt: skip

    found = across_workers.once(tmp_path_factory, "container", build)
    return ImageRun(Path(found["workdir"]), found["cfg"], Path(found["recipe"]), found["seconds"])


@pytest.fixture
def image_workdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Each test that uses it alone in the image's working directory, whichever worker runs it
    (the SLURM run of a task image runs with the cluster's tests)."""
    with work_locked(tmp_path_factory):
        yield


def work_locked(factory: pytest.TempPathFactory) -> contextlib.AbstractContextManager[None]:
    """The image's working directory, for this process alone while the block runs."""
    return across_workers.locked(across_workers.shared_root(factory) / "container.work")


def container_config(
    task: str = "ddppipe.tasks.mnist", script: str | None = None, **container: Any
) -> dict[str, Any]:
    """The default config, validated (every default filled in), with these settings."""
    cfg = config.validate(default_config())
    cfg.update(task=task, script=script)
    cfg["container"].update(container)
    return cfg


def container_spec(
    task: str = "ddppipe.tasks.mnist", script: str | None = None, gpus: bool = False,
    **container: Any,
) -> run_spec.RunSpec:  # fmt: skip
    """That config's spec, training on GPUs or not (``gpus``)."""
    return run_spec.resolve(container_config(task, script, **container), gpus)


def sources_edited_since(image: Path) -> bool:
    """Whether an input of rule build_image changed after ``image`` was built (someone working
    in this checkout while the tests run): then the DAG rightly schedules a rebuild."""
    src = REPO / "src" / "ddppipe"
    sources = [REPO / "pyproject.toml", *src.rglob("*.py"), *src.rglob("*.yaml")]
    built = image.stat().st_mtime
    return any(p.stat().st_mtime > built for p in sources)


def dag_jobs(workdir: Path, cfg: dict[str, Any], *args: str) -> dict[str, int]:
    """Rule -> jobs of a dry run (args: options and targets; default the image), {} when there
    is nothing to do."""
    out = snakemake(workdir, cfg, "-n", *(args or (IMAGE,))).stdout
    table = out.split("Job stats:")[1] if "Job stats:" in out else ""
    return {m[0]: int(m[1]) for m in re.findall(r"^(\w+)\s+(\d+)$", table, re.M)}
