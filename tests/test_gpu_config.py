"""GPU runs configured here, without a GPU: the SLURM request per scaling point, and GPU runs
refused before anything runs when their image has no CUDA."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from ddppipe.apptainer import gpu_check, identity, tool
from ddppipe.settings import run_spec
from tests.tiny import REPO, default_config
from tests.workflow_helpers import snakemake

CPU_RECIPE = """\
Bootstrap: debootstrap
OSVersion: bookworm

%labels
    ddppipe.variant cpu
"""


def test_scaling_points_request_one_gpu_per_process(tmp_path: Path) -> None:
    """A dry run of the study on the SLURM profile: each point asks for as many GPUs as it
    runs processes, and memory per GPU process: 8,000 MB and the 14 MB its checkpoints pin
    (the MNIST CNN's 1,199,882 parameters and AdamW's state, 12 bytes each), rounded up."""
    cfg = default_config()
    cfg["launch"].update(device="gpu", nproc_per_node=4)
    cfg["scaling"].update(nodes=[1, 2], procs_per_node=[1, 2, 4], cpus_per_proc=[1])
    out = snakemake(tmp_path, cfg, "-n", "--profile", str(REPO / "profiles/slurm"), "scaling")
    pattern = (
        r"wildcards: run=(sweeps/scaling/nnodes=(\d)\+nproc_per_node=(\d)\+cpus_per_proc=1)\n"
        r"\s+resources: ([^\n]+)"
    )
    jobs = re.findall(pattern, out.stdout)
    train = [job for job in jobs if "slurm_extra=" in job[3]]  # the train rule's request
    assert len(train) == 6, out.stdout
    for run, nodes, procs, resources in train:
        assert f"gres=gpu:{procs}," in resources, (run, resources)
        mem_mb = {"1": 8100, "2": 16100, "4": 32100}[procs]
        assert f"nodes={nodes}," in resources and f"mem_mb={mem_mb}," in resources


@pytest.fixture
def gpu_container_config(tmp_path: Path) -> dict:
    cfg = default_config()
    cfg["launch"]["device"] = "gpu"
    cfg["container"].update(mode="apptainer", recipe=str(tmp_path / "cpu.def"))
    (tmp_path / "cpu.def").write_text(CPU_RECIPE)
    return cfg


def test_gpus_with_a_cpu_only_recipe_are_a_config_error(
    gpu_container_config: dict, tmp_path: Path
) -> None:
    result = snakemake(tmp_path / "wd", gpu_container_config, "-n", check=False)
    assert result.returncode != 0
    text = result.stdout + result.stderr
    assert "GPUs are requested (launch.device: gpu" in text, text
    assert "builds a CPU-only image (ddppipe.variant cpu)" in text
    assert "container.recipe: containers/ddppipe.def" in text and "Traceback" not in text


def test_a_built_image_answers_with_its_labels(gpu_container_config: dict, tmp_path: Path) -> None:
    """A built image's labels decide, as long as it was built from the recipe."""
    recipe = Path(gpu_container_config["container"]["recipe"])
    image = tmp_path / "img.sif"
    info = {"path": str(image), "recipe_sha256": identity.sha256(recipe), "labels": {}}

    def check(labels: dict[str, str]) -> None:
        identity.info_path(image).write_text(json.dumps({**info, "labels": labels}))
        gpu_check.check_gpu_image(run_spec.resolve(gpu_container_config, True), recipe, image)

    with pytest.raises(tool.ContainerError, match="has a CPU-only torch"):
        check({"ddppipe.torch.version": "2.14.1+cpu"})
    check({"ddppipe.cuda.version": "13.0"})  # CUDA image: fine, whatever the recipe says
    gpu_container_config["launch"]["device"] = "cpu"
    cpu = run_spec.resolve(gpu_container_config, False)
    gpu_check.check_gpu_image(cpu, recipe, tmp_path / "none.sif")  # a CPU run: nothing to check


def test_auto_on_a_gpu_host_trains_where_the_image_can(
    gpu_container_config: dict, tmp_path: Path
) -> None:
    """launch.device auto with Apptainer on a host with NVIDIA GPUs (a stand-in nvidia-smi on
    the PATH: no GPU here): the run is decided once, on CPUs with a CPU-only image (no
    error), on GPUs (apptainer exec --nv) with the CUDA recipe; write_config records it."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
    (bindir / "nvidia-smi").chmod(0o755)
    env = {"PATH": f"{bindir}:{os.environ['PATH']}"}
    cfg = gpu_container_config
    cfg["launch"]["device"] = "auto"

    def write_config(workdir: Path) -> str:
        result = snakemake(workdir, cfg, "-n", "-p", "results/mnist/config.yaml", env=env)
        (line,) = [x for x in result.stdout.splitlines() if "ddppipe resolve-config" in x]
        return line

    on_cpus = write_config(tmp_path / "cpu")
    assert "--gpus no" in on_cpus and "--nv" not in on_cpus, on_cpus
    cfg["container"]["recipe"] = str(REPO / "containers" / "ddppipe.def")
    on_gpus = write_config(tmp_path / "gpu")
    assert "--gpus yes" in on_gpus and "apptainer exec --nv " in on_gpus, on_gpus
    # submitted to SLURM (the profile names the executor, known before Snakemake chose it):
    # auto is CPUs there, whatever GPUs the submitting machine has
    slurm = ["--profile", str(REPO / "profiles/slurm")]
    result = snakemake(tmp_path / "slurm", cfg, "-n", "-p", *slurm, "results/mnist/config.yaml",
                       env=env)  # fmt: skip
    (on_slurm,) = [x for x in result.stdout.splitlines() if "ddppipe resolve-config" in x]
    assert "--gpus no" in on_slurm and "--nv" not in on_slurm, on_slurm


def test_the_image_check_runs_once_per_device_and_container(
    gpu_container_config: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep's trials (other learning rates, one container section) share one check of the
    image; another image is checked again."""
    looked: list[Path] = []
    monkeypatch.setattr(gpu_check, "cpu_only", lambda recipe, info: looked.append(info))
    check, recipe = gpu_check.GpuImageCheck(), gpu_container_config["container"]["recipe"]
    for lr in (0.1, 0.01, 0.001):
        gpu_container_config["train"]["lr"] = lr
        check(run_spec.resolve(gpu_container_config, True), recipe)
    assert len(looked) == 1
    gpu_container_config["container"]["image"] = str(tmp_path / "other.sif")
    check(run_spec.resolve(gpu_container_config, True), recipe)
    assert len(looked) == 2 and looked[-1] == identity.info_path(tmp_path / "other.sif")


def test_the_script_apis_info_makes_the_ranks_gpu_the_current_device(
    monkeypatch, tmp_path: Path
) -> None:
    """Local rank 1 of a GPU script run: job.info() names cuda:1 and makes it the current
    device (FSDP2's state, NCCL and should_stop()'s all-reduce use the current one; it was
    cuda:0 on every rank). The GPU is a stand-in here: torch's device calls are recorded."""
    import torch

    from ddppipe.core import slot
    from ddppipe.parallel import devices
    from ddppipe.training.script import job

    current: list[torch.device] = []
    monkeypatch.setattr(devices, "select", lambda rank, size, use: torch.device("cuda", rank))
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    record = slot.Slot("gpu-script", str(tmp_path), device="gpu")
    env = {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "RANK": "3", "WORLD_SIZE": "4",
           **slot.write(record, tmp_path / "slot.json")}  # fmt: skip
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert job.info().device == "cuda:1"
    assert current == [torch.device("cuda", 1)]


def test_the_gpu_tests_call_what_the_code_has() -> None:
    """tests/test_gpu.py runs only on a GPU: checked here against the code, without one. Every
    attribute it reads of a ddppipe module exists, and no local name hides such a module (its
    provenance check called nccl_version() on the dict named like the module)."""
    import ast
    import importlib

    tree = ast.parse((REPO / "tests" / "test_gpu.py").read_text())
    modules = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ddppipe"):
            for alias in node.names:  # (a module's name; a function's is checked on import)
                try:
                    found = importlib.import_module(f"{node.module}.{alias.name}")
                except ModuleNotFoundError:
                    continue
                modules[alias.asname or alias.name] = found
    assert modules, "test_gpu.py imports no ddppipe module"
    missing = [
        f"{node.value.id}.{node.attr} (line {node.lineno})"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
        and node.value.id in modules and not hasattr(modules[node.value.id], node.attr)
    ]  # fmt: skip
    hidden = [
        f"{node.id} (line {node.lineno})"
        for node in ast.walk(tree)
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and node.id in modules
    ]
    assert (missing, hidden) == ([], [])
