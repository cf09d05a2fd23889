"""The Apptainer image: the recipe, a real build by the DAG, training and evaluation inside it.

One session fixture builds the CUDA + NCCL image users deploy (containers/ddppipe.def) once,
by running the whole local DAG with ``container.mode: apptainer`` on tiny data (2 processes,
CPU); the other tests reuse that image and workdir.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from ddppipe import container, provenance
from tests.tiny import REPO, TinyData, tiny_config
from tests.workflow_helpers import snakemake

# The session fixture builds the image (about 6 min on 2 cores), counted in the first test's time.
pytestmark = [pytest.mark.apptainer, pytest.mark.timeout(2700)]

IMAGE = "results/images/ddppipe.sif"
SECTIONS = ("%files", "%post", "%environment", "%test", "%labels", "%help")


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
    """The local DAG, image build included, run end to end through the image (once)."""
    require_apptainer()
    root = tmp_path_factory.mktemp("container")
    recipe = root / "recipe" / "ddppipe.def"
    recipe.parent.mkdir()
    shutil.copy2(REPO / "containers" / "ddppipe.def", recipe)
    cfg = tiny_config(tiny)
    cfg["container"] = {"mode": "apptainer", "recipe": str(recipe), "image": IMAGE, "exec_args": []}
    workdir = root / "work"
    start = time.monotonic()
    snakemake(workdir, cfg, "--cores", "2", timeout=2400)
    return ImageRun(workdir, cfg, recipe, time.monotonic() - start)


# -- without an image --------------------------------------------------------------------------


def test_one_recipe_with_the_tests_torch() -> None:
    """What CI builds is what ships: the default recipe, torch pinned to the tests' own."""
    path = REPO / "containers" / "ddppipe.def"
    assert sorted(p.name for p in (REPO / "containers").iterdir()) == ["ddppipe.def"]
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    assert cfg["container"]["recipe"] == "containers/ddppipe.def"
    text = path.read_text()
    for section in SECTIONS:
        assert re.search(rf"^{section}\s*$", text, re.M), f"{section} missing"
    assert container.recipe_labels(path)["ddppipe.variant"] == "cuda"
    assert "constraints.txt" in text and "libibverbs1 ibverbs-providers librdmacm1" in text
    pin = re.search(r"^torch==(\S+)$", (REPO / "constraints.txt").read_text(), re.M)
    assert pin and torch.__version__.split("+")[0] == pin[1], "the tests run another torch"


def test_exec_prefix() -> None:
    cfg = {"container": {"mode": "apptainer", "image": "i.sif", "exec_args": ["--bind", "/d"]}}
    assert container.exec_prefix(cfg, gpus=True) == [
        "apptainer",
        "exec",
        "--nv",
        "--bind",
        "/d",
        "i.sif",
    ]
    assert container.python_command(cfg, gpus=False)[-2:] == ["i.sif", "python"]
    assert container.exec_prefix({"container": {"mode": "none"}}) == []
    assert container.python_command({}) == [sys.executable]


def test_failed_build_leaves_no_image(tmp_path: Path) -> None:
    require_apptainer()
    recipe = tmp_path / "broken.def"
    recipe.write_text("Bootstrap: no-such-bootstrap\nFrom: nothing\n")
    image, log = tmp_path / "out" / "x.sif", tmp_path / "build.log"
    with pytest.raises(container.ContainerError, match=r"broken\.def failed.*build\.log"):
        container.build(recipe, image, log, REPO)
    assert list(image.parent.iterdir()) == []
    assert log.read_text()


# -- with the image built by the DAG -----------------------------------------------------------


def test_dag_trains_in_image_and_records_digest(image_run: ImageRun) -> None:
    w = image_run.workdir
    info = json.loads((w / "results/images/ddppipe.json").read_text())
    assert info["sha256"] == container.sha256(image_run.image)
    labels = info["labels"]
    assert labels["ddppipe.variant"] == "cuda"
    # The image ships the stack the tests run: torch, CUDA, cuDNN, NCCL of the host's build.
    host = provenance.software()
    for key in ("torch", "cuda", "cudnn", "nccl"):
        assert labels[f"ddppipe.{key}.version"] == host[key], key
    record = json.loads((w / "results/tiny/export/provenance.json").read_text())
    assert record["container"]["sha256"] == info["sha256"]
    assert record["training"]["world_size"] == 2
    # The ranks ran the image's stack (its own Python), recorded in the provenance.
    for key in ("torch", "cuda", "cudnn", "nccl"):
        assert record["software"][key] == labels[f"ddppipe.{key}.version"], key
    assert record["software"]["python"] != host["python"]  # Debian's, in the image
    assert "apptainer exec" in (w / "logs/tiny/train.log").read_text()
    assert json.loads((w / "results/tiny/eval/metrics.json").read_text())["test_accuracy"] >= 0
    print(f"build + DAG: {image_run.seconds:.0f} s, image {info['size_bytes'] / 2**20:.0f} MiB")
    print("labels:", {k: v for k, v in labels.items() if k.startswith("ddppipe.")})


def test_image_checks_pass(image_run: ImageRun) -> None:
    """The recipe's %test (versions, NCCL, cuDNN, InfiniBand libraries, selfcheck) on the
    built image, and the RDMA libraries NCCL loads for InfiniBand."""
    result = subprocess.run(["apptainer", "test", str(image_run.image)], capture_output=True,
                            text=True, timeout=300, check=False)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert '"ddp_step": true' in result.stdout and "rdma providers" in result.stdout
    probe = "import ctypes; ctypes.CDLL('libibverbs.so.1'); ctypes.CDLL('librdmacm.so.1')"
    subprocess.run(["apptainer", "exec", str(image_run.image), "python", "-c", probe],
                   check=True, timeout=120)  # fmt: skip


def test_exec_by_hand(image_run: ImageRun) -> None:
    """The README's commands: torchrun (2 processes), evaluate and export, through the image."""
    w, img = image_run.workdir, IMAGE

    def run(*cmd: str) -> None:
        r = subprocess.run(cmd, cwd=w, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"{cmd} failed:\n{r.stdout}\n{r.stderr}"

    out = "hand"
    env_cfg = w / "results/tiny/config.yaml"
    run(
        "apptainer",
        "exec",
        img,
        "python",
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "ddppipe",
        "train",
        f"--config={env_cfg}",
        "--data=resources/mnist",
        f"--state={out}/state",
        f"--checkpoint={out}/final.pt",
        f"--metrics={out}/metrics.jsonl",
    )
    run(
        "apptainer",
        "exec",
        img,
        "ddppipe",
        "evaluate",
        f"--checkpoint={out}/final.pt",
        "--data=resources/mnist",
        f"--metrics={out}/eval.json",
        f"--plot={out}/cm.png",
    )
    run(
        sys.executable,
        "-m",
        "ddppipe",
        "export",
        f"--checkpoint={out}/final.pt",
        "--data=resources/mnist",
        f"--weights={out}/model.pt",
        f"--provenance={out}/provenance.json",
        "--image-info=results/images/ddppipe.json",
    )
    snap = torch.load(w / out / "final.pt", weights_only=True)
    assert snap["meta"]["world_size"] == 2
    record = json.loads((w / out / "provenance.json").read_text())
    assert record["container"]["sha256"] == container.sha256(image_run.image)


def test_rebuild_only_when_recipe_changes(image_run: ImageRun) -> None:
    w, cfg, recipe = image_run.workdir, image_run.cfg, image_run.recipe
    # Unchanged inputs: no rebuild. (A source file edited since the build, e.g. by someone
    # working in this checkout while the tests run, rightly schedules one.)
    src = REPO / "src" / "ddppipe"
    sources = [REPO / "pyproject.toml", *src.rglob("*.py"), *src.glob("*.yaml")]
    built = image_run.image.stat().st_mtime
    edited = [p for p in sources if p.stat().st_mtime > built]
    if not edited:
        assert "build_image" not in _jobs(w, cfg)
    # A changed recipe schedules a rebuild. (Snakemake ignores a mere touch of a small input
    # whose content checksum it recorded, so change the content.)
    text = recipe.read_text()
    before = recipe.stat()
    try:
        recipe.write_text(text + "\n# changed\n")
        assert _jobs(w, cfg).get("build_image") == 1
    finally:
        recipe.write_text(text)
        os.utime(recipe, ns=(before.st_atime_ns, before.st_mtime_ns))


def _jobs(workdir: Path, cfg: dict[str, Any]) -> dict[str, int]:
    """Rule -> jobs of a dry run for the image ({} when there is nothing to do)."""
    out = snakemake(workdir, cfg, "-n", IMAGE).stdout
    table = out.split("Job stats:")[1] if "Job stats:" in out else ""
    return {m[0]: int(m[1]) for m in re.findall(r"^(\w+)\s+(\d+)$", table, re.M)}


def test_config_default_is_no_container() -> None:
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    assert cfg["container"]["mode"] == "none"
