"""The Apptainer image: the recipe, a real build by the DAG, training and evaluation inside it.

One session fixture builds the CUDA + NCCL image users deploy (containers/ddppipe.def) once,
by running the whole local DAG with ``container.mode: apptainer`` on tiny data (2 processes,
CPU); the other tests reuse that image and workdir.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from ddppipe.apptainer import binds, building, gpu_check, identity, running, tool
from ddppipe.parallel import software
from ddppipe.runstate import node_beats
from tests.container_fixtures import (
    IMAGE,
    IMAGE_TESTS,
    ImageRun,
    container_spec,
    dag_jobs,
    require_apptainer,
    sources_edited_since,
)
from tests.tiny import REPO

pytestmark = IMAGE_TESTS

SECTIONS = ("%files", "%post", "%environment", "%test", "%labels", "%help")


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
    assert gpu_check.recipe_labels(path)["ddppipe.variant"] == "cuda"
    assert "constraints.txt" in text and "libibverbs1 ibverbs-providers librdmacm1" in text
    pin = re.search(r"^torch==(\S+)$", (REPO / "constraints.txt").read_text(), re.M)
    assert pin and torch.__version__.split("+")[0] == pin[1], "the tests run another torch"


def test_exec_prefix() -> None:
    settings = {"mode": "apptainer", "image": "i.sif", "exec_args": ["--bind", "/d"]}
    assert running.exec_prefix(container_spec(gpus=True, **settings)) == [
        "apptainer",
        "exec",
        "--nv",
        "--bind",
        "/d",
        "i.sif",
    ]
    assert running.python_command(container_spec(**settings))[-2:] == ["i.sif", "python"]
    assert running.exec_prefix(container_spec()) == []  # container.mode: none
    assert running.python_command(container_spec()) == [sys.executable]


def test_user_binds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The folders of the task file and the script are bound at their own paths, once."""
    root = tmp_path.resolve()
    work, scripts, real = root / "work", root / "scripts", root / "real"
    for folder in (work / "tasks" / "sub", scripts, real):
        folder.mkdir(parents=True)
    (work / "linked").symlink_to(real)
    monkeypatch.chdir(work)

    def argv(task: str, script: str | None = None, exec_args: tuple[str, ...] = ()) -> list[str]:
        spec = container_spec(task, script, mode="apptainer", image="i.sif",
                              exec_args=list(exec_args))  # fmt: skip
        return running.exec_prefix(spec)

    bind = "--bind"
    # (sorted by path)
    beats = str(node_beats.local_base())  # (contained: the ranks' node-local heartbeats)
    assert argv("tasks/cifar.py", str(scripts / "train.py"), ("--contain",)) == [
        "apptainer", "exec", "--contain", bind, str(scripts), bind, f"{work}/tasks", bind, beats,
        "i.sif",
    ]  # fmt: skip
    assert argv("ddppipe.tasks.mnist") == ["apptainer", "exec", "i.sif"]  # a module: no bind
    # A folder inside another bound one, or already bound at its path: not bound again.
    assert argv("cifar.py", "tasks/sub/train.py") == ["apptainer", "exec", bind, str(work), "i.sif"]
    same = ("-B", f"/opt,{scripts}:{scripts}:ro")
    assert argv("tasks/sub/a.py", "../scripts/t.py", same) == [
        "apptainer", "exec", *same, bind, f"{work}/tasks/sub", "i.sif"
    ]  # fmt: skip
    elsewhere = ("--bind", f"{scripts}:/data")  # not at the same path
    assert argv("ddppipe.tasks.mnist", f"{scripts}/t.py", elsewhere)[-3:] == [bind, str(scripts),
                                                                               "i.sif"]  # fmt: skip
    # A symlinked folder: as written and where it resolves to; a missing folder: left out.
    assert binds.user_binds(container_spec("linked/t.py", "missing/t.py")) == [
        str(real), f"{work}/linked"
    ]  # fmt: skip
    assert binds.user_binds(container_spec("a.py"), cwd=scripts) == [str(scripts)]
    # a folder whose path has a comma: a quoted --mount (--bind would split it)
    (root / "a,b").mkdir()
    assert argv(f"{root}/a,b/t.py") == [
        "apptainer", "exec", "--mount", f'type=bind,"src={root}/a,b","dst={root}/a,b"', "i.sif"
    ]  # fmt: skip


def test_failed_build_leaves_no_image(tmp_path: Path) -> None:
    require_apptainer()
    recipe = tmp_path / "broken.def"
    recipe.write_text("Bootstrap: no-such-bootstrap\nFrom: nothing\n")
    image, log = tmp_path / "out" / "x.sif", tmp_path / "build.log"
    with pytest.raises(tool.ContainerError, match=r"broken\.def failed.*build\.log"):
        building.build(recipe, image, log, REPO)
    assert list(image.parent.iterdir()) == []
    assert log.read_text()


# -- with the image built by the DAG -----------------------------------------------------------


def test_dag_trains_in_image_and_records_digest(image_run: ImageRun) -> None:
    w = image_run.workdir
    info = json.loads((w / "results/images/ddppipe.json").read_text())
    assert info["sha256"] == identity.sha256(image_run.image)
    labels = info["labels"]
    assert labels["ddppipe.variant"] == "cuda"
    # The image ships the stack the tests run: torch, CUDA, cuDNN, NCCL of the host's build.
    host = software.stack()
    for key in ("torch", "cuda", "cudnn", "nccl"):
        assert labels[f"ddppipe.{key}.version"] == host[key], key
    # Its packages, which `ddppipe reproduce` compares a container run's record with.
    packages = identity.packages(labels)
    assert packages is not None and len(packages) > 20, labels
    assert packages["ddppipe"] == labels["ddppipe.installed.version"]
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
        f"--config={env_cfg}",
    )
    run(
        sys.executable,
        "-m",
        "ddppipe",
        "export",
        f"--result={out}/model.pt",
        f"--record={out}/final.json",
        f"--config={env_cfg}",
        "--data=resources/mnist",
        f"--out={out}/export.pt",
        f"--provenance={out}/provenance.json",
        "--image-info=results/images/ddppipe.json",
    )
    snap = torch.load(w / out / "final.pt", weights_only=True)
    assert snap["meta"]["world_size"] == 2
    record = json.loads((w / out / "provenance.json").read_text())
    assert record["container"]["sha256"] == identity.sha256(image_run.image)


def test_rebuild_only_when_recipe_changes(image_run: ImageRun) -> None:
    w, cfg, recipe = image_run.workdir, image_run.cfg, image_run.recipe
    # Unchanged inputs: no rebuild. (A source file edited since the build, e.g. by someone
    # working in this checkout while the tests run, rightly schedules one.)
    if not sources_edited_since(image_run.image):
        assert "build_image" not in dag_jobs(w, cfg)
    # A changed recipe schedules a rebuild. (Snakemake ignores a mere touch of a small input
    # whose content checksum it recorded, so change the content.)
    text = recipe.read_text()
    before = recipe.stat()
    try:
        recipe.write_text(text + "\n# changed\n")
        assert dag_jobs(w, cfg).get("build_image") == 1
    finally:
        recipe.write_text(text)
        os.utime(recipe, ns=(before.st_atime_ns, before.st_mtime_ns))


def test_config_default_is_no_container() -> None:
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    assert cfg["container"]["mode"] == "none"
