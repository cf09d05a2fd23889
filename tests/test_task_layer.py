"""The task's own packages as a layer over the image (``container.requirements``): the list
pinned and named by its hash, pip's settings in the image, and one real layer (a task file that
imports blobfmt, a local wheel, beside torchver, a local sdist whose build imports torch:
tests/local_wheel.py) through the whole local DAG and on the SLURM test cluster, over the
image tests/test_container.py's tests use (built once a session: tests/container_fixtures.py);
layers the image cannot build or import refused, leaving nothing.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from ddppipe.apptainer import binds, identity, layer, layer_checks, requirements, running, tool
from ddppipe.core import hashing
from ddppipe.parallel import software
from ddppipe.reproduce import checks, command
from ddppipe.settings import config
from tests import across_workers
from tests.container_fixtures import (
    IMAGE,
    IMAGE_TESTS,
    ImageRun,
    container_spec,
    dag_jobs,
    sources_edited_since,
    work_locked,
)
from tests.local_wheel import blobfmt_wheels, cppext_sdist, torchver_sdist, wheel_of
from tests.slurm_cluster import SlurmCluster
from tests.test_slurm import logs, on_cluster, snakemake_slurm
from tests.tiny import REPO
from tests.workflow_helpers import snakemake

pytestmark = IMAGE_TESTS


# -- without an image --------------------------------------------------------------------------


def test_requirements_pinned_and_named_by_hash() -> None:
    """container.requirements: pinned or refused with a hint; the list names the task's layer,
    bound over the image read-only, first on Python's path, the user's site off."""
    reqs = ["tabulate==0.9.0", "Foo_Bar[x,y]==1.0.post1"]
    spec = container_spec(mode="apptainer", image=IMAGE, requirements=reqs)
    assert requirements.requirements(spec.container) == [
        "Foo_Bar[x,y]==1.0.post1", "tabulate==0.9.0"
    ]  # fmt: skip
    found = running.task_layer(spec.container)
    assert found is not None
    assert re.fullmatch(r"results/images/ddppipe-[0-9a-f]{12}\.layer\.sqfs", str(found))
    assert found == requirements.layer_path(IMAGE, list(reversed(reqs)))
    assert identity.info_path(found).name == found.name.replace(".sqfs", ".json")
    assert running.run_image(spec.container) == IMAGE  # the image itself: the layer over it
    assert running.exec_prefix(spec) == [
        "apptainer", "exec", "--bind", f"{found}:/opt/task-site:ro,image-src=/",
        "--env", "PYTHONPATH=/opt/task-site", "--env", "PYTHONNOUSERSITE=1", IMAGE,
    ]  # fmt: skip
    assert running.python_command(spec)[-2:] == [IMAGE, "python"]
    assert running.task_layer(container_spec(image=IMAGE).container) is None  # none required
    assert requirements.layer_path(IMAGE, ["tabulate==0.8.10"]) != found
    for loose in ("tabulate", "tabulate>=0.9", "numpy==2.*", "git+https://x/y.git", "a==1 ; b"):
        with pytest.raises(tool.ContainerError, match=r"pinned as name==version"):
            requirements.requirements(replace(spec.container, requirements=(loose,)))
        bad = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
        bad["container"]["requirements"] = [loose]
        with pytest.raises(
            config.ConfigError, match=r"container\.requirements\.0: .* does not match"
        ):
            config.validate(bad)
    with pytest.raises(tool.ContainerError, match=r"'tabulate>=0\.9': write tabulate==VERSION"):
        requirements.requirements(replace(spec.container, requirements=("tabulate>=0.9",)))


def test_a_bind_of_a_path_with_a_comma_or_colon_is_a_quoted_mount(tmp_path: Path) -> None:
    """``--bind`` splits its value at commas and colons and cannot escape them (Apptainer
    1.4.5: a layer beside an image in ``/data/a,b`` ended in "failed to load data image b/...");
    such a path is bound with ``--mount``, its fields quoted as CSV (checked by hand there: the
    layer's file readable at its target); other paths, spaces too, keep ``--bind``."""
    opts = ("ro", "image-src=/")
    assert binds.bind_args("/my data/l.sqfs", "/opt/task-site", opts) == [
        "--bind", "/my data/l.sqfs:/opt/task-site:ro,image-src=/"
    ]  # fmt: skip
    assert binds.bind_args("/w", "/w") == ["--bind", "/w:/w"]
    assert binds.bind_args("/data/a,b/l.sqfs", "/opt/task-site", opts) == [
        "--mount", 'type=bind,"src=/data/a,b/l.sqfs",dst=/opt/task-site,ro,image-src=/'
    ]  # fmt: skip
    assert binds.bind_args("/data/c:d", "/data/c:d") == [
        "--mount", "type=bind,src=/data/c:d,dst=/data/c:d"
    ]  # fmt: skip
    image = tmp_path / "a,b" / "ddppipe.sif"
    spec = container_spec(mode="apptainer", image=str(image), requirements=["tabulate==0.9.0"])
    found = running.task_layer(spec.container)
    assert running.layer_args(spec.container)[:2] == [
        "--mount", f'type=bind,"src={found}",dst=/opt/task-site,ro,image-src=/'
    ]  # fmt: skip


def test_a_layer_built_over_another_image_is_refused_before_training(tmp_path: Path) -> None:
    """The image rebuilt or replaced after its task layer (an image copied in with an older
    time, a rule run by hand): the launcher refuses to bind the layer, whose packages were
    resolved against another image's, before any process trains (the provenance's export
    refused it only after the training); a layer over this image is bound."""
    image = tmp_path / "ddppipe.sif"
    spec = container_spec(mode="apptainer", image=str(image), requirements=["tabulate==0.9.0"])
    found = running.task_layer(spec.container)
    assert found is not None
    assert running.python_command(spec)[-2:] == [str(image), "python"]  # no info yet: unbuilt
    now = {"path": str(image), "sha256": "b" * 64}
    base = {"path": str(image), "sha256": "a" * 64}
    built = {"path": str(found), "sha256": "c" * 64, "base": base}
    identity.info_path(image).write_text(json.dumps(now))
    identity.info_path(found).write_text(json.dumps(built))
    expected = (
        f"the task layer {found} was built over an image with SHA-256 aaaaaaaaaaaa, not "
        f"{image} (bbbbbbbbbbbb): the image was rebuilt or replaced since; run the workflow "
        "again (rule build_task_layer builds the layer over it)"
    )
    with pytest.raises(tool.ContainerError) as raised:
        running.python_command(spec)
    assert str(raised.value) == expected
    with pytest.raises(tool.ContainerError, match="was built over an image with SHA-256 aaaa"):
        identity.container_record(now, built)
    built["base"]["sha256"] = now["sha256"]
    identity.info_path(found).write_text(json.dumps(built))
    assert running.python_command(spec)[-2:] == [str(image), "python"]
    assert identity.container_record(now, built) == {**now, "layer": built}


def test_layer_pip_settings_and_what_it_installed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The image's pip gets the host's index, wheel folder and proxy settings and CA bundle,
    nothing else of the host's (no pip configuration file, no PYTHONPATH); what a layer
    installed is read from its folder by lower-case name, as the provenance names packages."""
    for key in list(os.environ):
        if key in layer.PASSED or key == "PIP_CERT":
            monkeypatch.delenv(key)
    monkeypatch.setenv("PIP_INDEX_URL", "https://mirror.example/simple")
    monkeypatch.setenv("https_proxy", "http://proxy:3128")
    monkeypatch.setenv("PYTHONPATH", "/home/me/src")
    monkeypatch.setenv("PIP_REQUIRE_VIRTUALENV", "1")
    (tmp_path / "ca.crt").write_text("a CA bundle")
    env = layer._environment(tmp_path)
    assert env[::2] == ["--env"] * (len(env) // 2)
    assert sorted(env[1::2]) == sorted([
        "PIP_CONFIG_FILE=/dev/null", "PIP_DISABLE_PIP_VERSION_CHECK=1",
        "PIP_ROOT_USER_ACTION=ignore", "PYTHONNOUSERSITE=1", "SOURCE_DATE_EPOCH=0",
        f"PIP_CERT={tmp_path / 'ca.crt'}", "PIP_INDEX_URL=https://mirror.example/simple",
        "https_proxy=http://proxy:3128",
    ])  # fmt: skip
    site = tmp_path / "site"
    for name, version in (("Foo_Bar", "1.0.post1"), ("blobfmt", "1.0")):
        meta = site / f"{name}-{version}.dist-info" / "METADATA"
        meta.parent.mkdir(parents=True)
        meta.write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\nSummary: x\n")
    (site / "foo_bar").mkdir()
    assert layer.installed(site) == ["blobfmt==1.0", "foo_bar==1.0.post1"]


def test_a_layer_whose_packing_times_out_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """mksquashfs stopped at its time limit: ContainerError naming it and the log (not a
    TimeoutExpired traceback), and no temporary file beside the layer; one too old for
    reproducible bytes refused with what to do for a layer."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "a.py").write_text("x = 1\n" * 100_000)
    dest, log = tmp_path / "images" / "x.layer.sqfs", tmp_path / "layer.log"
    dest.parent.mkdir()
    monkeypatch.setattr(layer, "SQUASH_TIMEOUT_S", 0.001)
    with pytest.raises(tool.ContainerError, match=r"did not end within 0\.001 s .*layer\.log"):
        layer._squash(site, dest, log)
    assert list(dest.parent.iterdir()) == []
    # RHEL 8's squashfs-tools (4.3): what to do for the layer, not data.pack's advice
    old = tmp_path / "bin" / "mksquashfs"
    old.parent.mkdir()
    old.write_text("#!/bin/sh\necho 'mksquashfs version 4.3-git (2014/06/09)'\n")
    old.chmod(0o755)
    monkeypatch.setenv("PATH", f"{old.parent}:{os.environ['PATH']}")
    with pytest.raises(tool.ContainerError) as raised:
        layer._squash(site, dest, log)
    assert str(raised.value).startswith("container.requirements needs squashfs-tools 4.4 or ")
    assert str(raised.value).endswith(
        "this mksquashfs is 4.3: install a newer squashfs-tools (or put one first on PATH), or "
        "install the packages in the image's recipe instead"
    )


SETUP = b"from setuptools import setup\nsetup()\n"
TORCH_SETUP = b"import torch\nfrom setuptools import setup\n"
CUDA_SETUP = b"from torch.utils.cpp_extension import CUDAExtension\n"
HATCH = b'[build-system]\nrequires = ["hatchling>=1.18", "torch==2.5.1"]\n'


@pytest.mark.parametrize(
    ("members", "native", "cuda", "torch", "requires"),
    [  # (a source distribution's files: setup.py's and pyproject.toml's text, others None)
        ({"setup.py": SETUP, "p/__init__.py": None}, [], False, False, ["setuptools"]),
        ({"setup.py": TORCH_SETUP, "p/__init__.py": None}, [], False, True, ["setuptools"]),
        ({"setup.py": TORCH_SETUP, "p/ops.cpp": None, "p/a.h": None}, ["p/ops.cpp"], False, True,
         ["setuptools"]),
        ({"setup.py": SETUP, "p/fast.pyx": None, "p/c.c": None}, ["p/c.c", "p/fast.pyx"], False,
         False, ["setuptools"]),
        ({"setup.py": CUDA_SETUP, "p/k.cu": None, "p/k.cpp": None}, ["p/k.cpp", "p/k.cu"], True,
         True, ["setuptools"]),
        ({"pyproject.toml": HATCH, "p/__init__.py": None}, [], False, True, ["hatchling", "torch"]),
    ],
)  # fmt: skip
def test_what_a_source_distributions_build_needs(
    members: dict[str, bytes | None], native: list[str], cuda: bool, torch: bool,
    requires: list[str],
) -> None:  # fmt: skip
    """Read before pip builds it in the image: its sources to compile (a compiler and Python's
    headers), CUDA's (nvcc), whether its build imports torch (the image's), its build
    requirements (without isolation: the image's)."""
    assert layer_checks.needs(members) == {
        "native": native, "cuda": cuda, "torch": torch, "requires": requires
    }  # fmt: skip


def test_the_modules_a_layer_installs_and_their_packages(tmp_path: Path) -> None:
    """What the import check imports: each top-level module or package, the modules below a
    namespace folder (no __init__.py), nothing of a data folder, scripts or metadata; named
    by the package whose RECORD lists it."""
    files = {
        "blobfmt/__init__.py": "", "blobfmt/x.py": "", "six.py": "",
        "_ops.cpython-311-x86_64-linux-gnu.so": "", "nvidia/ddpsplit/__init__.py": "",
        "nvidia/ddpsplit/lib/libx.so": "", "share/doc/README": "", "bin/tool": "",
        "blobfmt-1.0.dist-info/METADATA": "Name: blobfmt\nVersion: 1.0\n",
        "blobfmt-1.0.dist-info/RECORD": "blobfmt/__init__.py,,\nblobfmt/x.py,,\n",
        "nvidia_ddpsplit-2.0.dist-info/METADATA": "Name: nvidia-ddpsplit\nVersion: 2.0\n",
        "nvidia_ddpsplit-2.0.dist-info/RECORD": "nvidia/ddpsplit/__init__.py,sha256=x,0\n",
    }  # fmt: skip
    for path, text in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    assert {k: str(v.relative_to(tmp_path)) for k, v in layer_checks.units(tmp_path).items()} == {
        "_ops": "_ops.cpython-311-x86_64-linux-gnu.so", "blobfmt": "blobfmt",
        "nvidia.ddpsplit": "nvidia/ddpsplit", "six": "six.py",
    }  # fmt: skip
    assert layer_checks.owners(tmp_path) == {
        "blobfmt": "blobfmt==1.0",
        "nvidia": "nvidia-ddpsplit==2.0",
    }


# -- a task whose package is only in its layer, over the image built by the DAG ----------------

BLOBSDEP = REPO / "tests" / "data" / "blobsdep.py"  # a user's task file: it imports blobfmt
BLOBFMT = "blobfmt==1.0"  # in neither the tests' environment nor the base image: a local wheel
TORCHVER = "torchver==1.0"  # a local sdist whose build imports torch: built in the image
LISTED = [BLOBFMT, TORCHVER]  # the run's container.requirements
# Every rule but build_image: the base image stays as the session built it, even if a source
# of ddppipe changes meanwhile (someone working in this checkout while the tests run).
# (--allowed-rules takes every word after it: targets go before it.)
BUT_THE_BASE_IMAGE = (
    "--allowed-rules", "build_task_layer", "data_config", "prepare_data", "write_config",
    "train", "evaluate", "plot_training", "attempt_history", "export", "summarize", "all",
)  # fmt: skip
# The rules whose command imports no torch and no user code (they stay on the host).
HOST_RULES = ("data_config", "evaluate", "plot_training", "attempt_history", "export", "summarize")


@dataclass(frozen=True)
class TaskLayerRun:
    workdir: Path
    cfg: dict[str, Any]
    layer: str  # the task's layer, relative to workdir
    output: str  # what snakemake printed (-p: every job's command)
    seconds: float  # the layer's build and the whole DAG
    env: dict[str, str]  # pip's settings: the local wheels, no index


def blobs_config(base: dict[str, Any], run: str, *reqs: str) -> dict[str, Any]:
    """The user's task file (copied to mytasks/) trained in the image, with ``reqs``."""
    cfg = copy.deepcopy(base)
    cfg.update(run=run, task="mytasks/blobsdep.py", task_args={})
    cfg["train"].update(epochs=1, batch_size=64, eval_batch_size=256)
    cfg["container"]["requirements"] = list(reqs)
    return cfg


@pytest.fixture(scope="session")
def task_layer_run(image_run: ImageRun, tmp_path_factory: pytest.TempPathFactory) -> TaskLayerRun:
    """`snakemake --cores 2` of a task file that imports blobfmt, with container.requirements:
    [blobfmt==1.0, torchver==1.0] (a local wheel and sdist: pip's --find-links, no index): the
    layer built once, then the whole local DAG, with Python's import profile
    (PYTHONPROFILEIMPORTTIME) in every rule's log."""
    assert importlib.util.find_spec("blobfmt") is None, "blobfmt must be absent from the host"
    w = image_run.workdir
    env = {"PIP_FIND_LINKS": str(w / "wheels"), "PIP_NO_INDEX": "1"}

    def build(_: Path) -> dict[str, Any]:
        blobfmt_wheels(w / "wheels", "1.0", "1.1")
        torchver_sdist(w / "wheels")
        (w / "mytasks").mkdir()
        shutil.copy2(BLOBSDEP, w / "mytasks" / "blobsdep.py")
        cfg = blobs_config(image_run.cfg, "blobs", *LISTED)
        start = time.monotonic()
        with work_locked(tmp_path_factory):
            result = snakemake(w, cfg, "--cores", "2", "-p", *BUT_THE_BASE_IMAGE,
                               env={"PYTHONPROFILEIMPORTTIME": "1", **env})  # fmt: skip
        return {"cfg": cfg, "output": result.stdout + result.stderr,
                "seconds": time.monotonic() - start}  # fmt: skip

    found = across_workers.once(tmp_path_factory, "task-layer", build)
    path = str(requirements.layer_path(IMAGE, LISTED))
    return TaskLayerRun(w, found["cfg"], path, found["output"], found["seconds"], env)


def where_rules_ran(output: str, found: str) -> dict[str, str]:
    """Rule -> "image" when Snakemake's printed command (-p) runs `ddppipe` through
    `apptainer exec ... IMAGE` with the task's layer ``found`` bound over it, else "host"."""
    chunks = re.split(r"^(?:local)?rule (\w+):$", output, flags=re.M)[1:]
    bind = re.escape(f"--bind {found}:/opt/task-site:ro,image-src=/ ")
    inside = re.compile(rf"apptainer exec (\S+ )*{bind}(\S+ )*{re.escape(IMAGE)} ddppipe ")
    return {rule: "image" if inside.search(text) else "host"
            for rule, text in zip(chunks[::2], chunks[1::2], strict=True)}  # fmt: skip


def test_task_with_an_image_only_package_trains_over_its_layer(
    task_layer_run: TaskLayerRun,
) -> None:
    """Every step that imports the task ran in the image with the task's layer bound over it
    (the host has no blobfmt): prepare_data, write_config and the ranks; the other rules on
    the host, without torch. The layer's info records the list, what it installed (only what
    the image lacks), what it built from source against which torch (torchver, built against
    the image's torch, not one from an index) and the base image; the provenance the layer and
    the image, which `ddppipe reproduce` checks."""
    run, w, found = task_layer_run, task_layer_run.workdir, task_layer_run.layer
    where = where_rules_ran(run.output, found)
    print(f"the layer (blobfmt) + the whole DAG: {run.seconds:.0f} s")
    print("where each rule ran:", where)
    for name in ("build_task_layer", "prepare_data/blobsdep", "blobs/write_config", "blobs/train"):
        print(f"benchmarks/{name}.tsv:", (w / f"benchmarks/{name}.tsv").read_text().split("\n")[1])
    assert where == {
        "build_task_layer": "host", "data_config": "host", "prepare_data": "image",
        "write_config": "image", "train": "host", "evaluate": "host", "plot_training": "host",
        "attempt_history": "host", "export": "host", "summarize": "host", "all": "host",
    }, where  # fmt: skip
    # train: the launcher on the host starts the ranks in the image, the layer over it
    train_log = (w / "logs/blobs/train.log").read_text()
    ranks = rf"apptainer exec (\S+ )*--bind {re.escape(found)}:\S+ (\S+ )*{IMAGE} python -m ddppipe"
    assert re.search(ranks, train_log), train_log[-3000:]
    # prepare() used blobfmt (intcomma) inside the image
    assert "blobsdep: 2,048 points, " in (w / "logs/prepare_data/blobsdep.log").read_text()
    metrics = json.loads((w / "results/blobs/eval/metrics.json").read_text())
    assert metrics["test_count"] == 512 and metrics["test_accuracy"] >= 0.99
    for rule in HOST_RULES:
        log = w / (
            "logs/data_config/blobsdep.log" if rule == "data_config" else f"logs/blobs/{rule}.log"
        )
        text = log.read_text()
        assert "| ddppipe.cli.main" in text, rule  # the import profile is there
        assert not re.search(r"\|\s+torch$", text, re.M), f"{rule} imported torch"
    # The layer and its info: a small file, what it installed, over which image.
    info = json.loads((w / identity.info_path(found)).read_text())
    base = json.loads((w / identity.info_path(IMAGE)).read_text())
    assert info["path"] == found and info["sha256"] == identity.sha256(w / found)
    assert info["requirements"] == LISTED and info["installed"] == LISTED
    assert info["base"] == {"path": IMAGE, "sha256": base["sha256"]}
    torch_built = base["labels"]["ddppipe.torch.version"]  # e.g. 2.14.1+cu130
    assert info["from_source"] == [{"package": TORCHVER, "compiled": False, "torch": torch_built}]
    assert squashed(w / found, "torchver/_built.py") == f"TORCH = {torch_built!r}\n"
    assert info["size_bytes"] == (w / found).stat().st_size < 2**20
    assert "ddppipe.requirements" not in identity.labels(w / IMAGE)  # the image unchanged
    # The run's identity and provenance: the task file's SHA-256, the image and its layer.
    task_sha = hashing.file_sha256(w / "mytasks/blobsdep.py")
    resolved = yaml.safe_load((w / "results/blobs/config.yaml").read_text())
    assert resolved["task_source"]["sha256"] == task_sha
    assert resolved["task_source"]["path"] == str((w / "mytasks/blobsdep.py").resolve())
    record = json.loads((w / "results/blobs/export/provenance.json").read_text())
    assert record["task"]["sha256"] == task_sha
    image = record["container"]
    assert image["path"] == IMAGE and image["sha256"] == base["sha256"]
    assert image["layer"] == info
    # rank 0 saw the image's packages and the layer's: the packages the record names
    assert record["software"]["packages"] == {
        **identity.packages(base["labels"]), "blobfmt": "1.0", "torchver": "1.0"
    }  # fmt: skip
    # `ddppipe reproduce`'s checks of the image, its layer and their packages
    old = os.getcwd()
    try:
        os.chdir(w)
        image_check = checks.image(image)
        packages_check = command._packages(record, image_check)
    finally:
        os.chdir(old)
    assert image_check.status == "ok", image_check.text
    assert image_check.text == (
        f"{IMAGE}: SHA-256 {base['sha256'][:12]} as recorded, its task layer {found}: SHA-256 "
        f"{info['sha256'][:12]} as recorded"
    )
    assert packages_check.status == "ok", packages_check.text
    assert packages_check.text.endswith(f"as recorded (the image {IMAGE}'s with its task layer)")


def test_a_changed_requirement_is_layered_alone_and_reruns_what_depends_on_it(
    task_layer_run: TaskLayerRun,
) -> None:
    """The same list: nothing to do. Another version: another layer (the base image not
    rebuilt), built in seconds, and every job that runs over it again (not data_config)."""
    w, cfg, env = task_layer_run.workdir, task_layer_run.cfg, task_layer_run.env
    assert dag_jobs(w, cfg, "all", *BUT_THE_BASE_IMAGE) == {}
    other = blobs_config(cfg, "blobs", "blobfmt==1.1")
    again = requirements.layer_path(IMAGE, ["blobfmt==1.1"])
    assert again != Path(task_layer_run.layer)
    if not sources_edited_since(w / IMAGE):  # (else a rebuild is rightly due)
        assert "build_image" not in dag_jobs(w, other, str(again))
    assert dag_jobs(w, other, "all", *BUT_THE_BASE_IMAGE) == {
        "build_task_layer": 1, "prepare_data": 1, "write_config": 1, "train": 1, "evaluate": 1,
        "plot_training": 1, "attempt_history": 1, "export": 1, "summarize": 1, "all": 1,
        "total": 10,
    }  # fmt: skip
    image_before = (w / IMAGE).stat().st_mtime_ns
    start = time.monotonic()
    snakemake(w, other, "--cores", "1", str(again), *BUT_THE_BASE_IMAGE, env=env)
    seconds = time.monotonic() - start
    info = json.loads((w / identity.info_path(again)).read_text())
    assert info["installed"] == ["blobfmt==1.1"] and info["sha256"] == identity.sha256(w / again)
    assert (w / IMAGE).stat().st_mtime_ns == image_before
    assert seconds < 60, f"re-layering one package took {seconds:.0f} s"
    print(f"a changed requirement re-layered (snakemake, one rule): {seconds:.1f} s")


def test_a_layer_that_cannot_be_installed_names_the_image_and_leaves_nothing(
    task_layer_run: TaskLayerRun, tmp_path: Path
) -> None:
    """A version no index has: the error says the image's packages are kept and what to do;
    no layer nor half-built folder is left where the next step would look. The run's list
    built again under `umask 077` (pip writes 0600 and 0700 files) gives the same bytes:
    every file root's and readable by every user, as a kernel mount needs."""
    w, env = task_layer_run.workdir, task_layer_run.env
    dest = tmp_path / "images" / "x.layer.sqfs"
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        with pytest.raises(tool.ContainerError) as error:
            layer.build_layer(w / IMAGE, ["blobfmt==9.9"], dest, tmp_path / "layer.log")
    assert "cannot be installed over the image" in str(error.value)
    assert "choose versions compatible with them, or one that exists" in str(error.value)
    assert "No matching distribution found for blobfmt==9.9" in str(error.value)
    assert list(dest.parent.iterdir()) == []
    # The same list built again: the same bytes (its byte-code names /opt/task-site, where it
    # is bound, not pip's temporary folder of the build), whatever the umask
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        umask = os.umask(0o077)
        try:
            again = layer.build_layer(w / IMAGE, LISTED, dest, tmp_path / "again.log")
        finally:
            os.umask(umask)
    built = json.loads((w / identity.info_path(task_layer_run.layer)).read_text())
    assert again["sha256"] == built["sha256"]
    listed = subprocess.run(["unsquashfs", "-lls", str(dest)], capture_output=True, text=True,
                            check=True).stdout.splitlines()  # fmt: skip
    modes = {line.split()[0] + " " + line.split()[1] for line in listed if "squashfs-root" in line}
    assert modes == {"drwxr-xr-x root/root", "-rw-r--r-- root/root"}, listed


def squashed(image: Path, path: str) -> str:
    """The text of the file ``path`` in the SquashFS file ``image``."""
    return subprocess.run(["unsquashfs", "-cat", str(image), path], capture_output=True,
                          text=True, check=True).stdout  # fmt: skip


def failed_layer(task_layer_run: TaskLayerRun, folder: Path, *reqs: str) -> str:
    """The error of building ``reqs`` (local packages in ``folder``, the run's beside them)
    over the run's image; asserted to leave nothing beside the layer."""
    dest = folder / "images" / "x.layer.sqfs"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PIP_NO_INDEX", "1")
        patch.setenv("PIP_FIND_LINKS", f"{folder} {task_layer_run.env['PIP_FIND_LINKS']}")
        with pytest.raises(tool.ContainerError) as error:
            layer.build_layer(task_layer_run.workdir / IMAGE, list(reqs), dest, folder / "l.log")
    assert list(dest.parent.iterdir()) == []
    return str(error.value)


def test_a_source_package_the_image_cannot_compile_is_refused_before_its_build(
    task_layer_run: TaskLayerRun, tmp_path: Path
) -> None:
    """A C++ extension over torch's headers, as a source distribution only: the image has no
    compiler, so the build is refused before it starts, naming the package and each thing the
    image lacks (not pip's compiler error minutes in, nor a layer that fails at import)."""
    cppext_sdist(tmp_path)
    message = failed_layer(task_layer_run, tmp_path, "cppext==1.0", BLOBFMT)
    assert "a source distribution pip would build in " in message
    assert (
        "  cppext==1.0: a source distribution (to compile: cppext/ops.cpp; its build imports "
        "torch), and the image lacks a C++ compiler (c++); a C compiler (cc); Python's headers "
        "(/usr/include/python3.11/Python.h: python3-dev)\n"
    ) in message, message
    assert "`apt-get install -y g++ python3-dev` in %post" in message


def test_a_layer_that_cannot_import_or_hides_half_a_namespace_is_never_used(
    task_layer_run: TaskLayerRun, tmp_path: Path
) -> None:
    """The layer's modules imported in the image with the layer bound, as every rank's: one
    that fails names itself and its package; a namespace the image also has (google, nvidia:
    no __init__.py in the image) imports both halves, or is named when the layer's
    __init__.py hides the image's. Nothing is left."""
    wheel_of(
        tmp_path, "badimport", "1.0", {"badimport.py": "raise ImportError('no libfoo.so.1')\n"}
    )
    wheel_of(tmp_path, "nvidia-ddpsplit", "1.0", {"nvidia/ddpsplit/__init__.py": "X = 1\n"})
    old_style = {"google/__init__.py": "", "google/ddpold/__init__.py": "X = 1\n"}  # regular
    wheel_of(tmp_path, "google-ddpold", "1.0", old_style)
    message = failed_layer(task_layer_run, tmp_path, "badimport==1.0", "google-ddpold==1.0",
                           "nvidia-ddpsplit==1.0")  # fmt: skip
    site = "/opt/venv/lib/python3.11/site-packages"
    reasons = message.split(":\n", 1)[1].split("\nA package that")[0].splitlines()
    assert reasons == [  # (nvidia.ddpsplit: both halves on nvidia.__path__, nothing to say)
        f"  the namespace google is split between the layer (/opt/task-site/google, from "
        f"google-ddpold==1.0) and the image ({site}/google), and Python imports only one half: "
        f"{site}/google hidden (an __init__.py in /opt/task-site/google)",
        "  badimport (from badimport==1.0) cannot be imported: ImportError: no libfoo.so.1",
    ], message
    assert message.startswith("container.requirements: not used: the layer cannot be imported")


def test_a_package_the_image_lacks_is_named_with_both_fixes(task_layer_run: TaskLayerRun) -> None:
    """The task's prepare in the base image (no blobfmt): the step, the image and both fixes."""
    w = task_layer_run.workdir
    settings = w / "resources" / "blobsdep.yaml"
    cmd = ["apptainer", "exec", IMAGE, "ddppipe", "prepare", f"--settings={settings}",
           "--dest=lacking"]  # fmt: skip
    result = subprocess.run(cmd, cwd=w, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    task = (w / "mytasks/blobsdep.py").resolve()
    assert (
        "ddppipe prepare: error: prepare_data (ddppipe prepare): task mytasks/blobsdep.py "
        f"({task}) imports blobfmt, which is not installed in the image {w / IMAGE}. Either "
        "add it to this image, container.requirements: [blobfmt==VERSION] (`pip index "
        "versions blobfmt` lists the versions; a module's pip package may have another "
        "name), or install it where this step runs: in the image's recipe (container.recipe)"
    ) in result.stderr, result.stderr


@pytest.mark.slurm
def test_task_with_an_image_only_package_on_slurm(
    task_layer_run: TaskLayerRun, slurm_cluster: SlurmCluster
) -> None:
    """The same task on the SLURM test cluster (2 nodes, 1 rank each): its data prepared over
    the layer on the submitting machine, the ranks over it on the cluster's nodes. A copy of
    the task file under another name, so its data (resources/, logs/prepare_data/) is its
    own: the local run's, which the other tests read, stays as it was whatever the order."""
    w = task_layer_run.workdir
    shutil.copy2(BLOBSDEP, w / "mytasks" / "blobsdep_slurm.py")
    cfg = blobs_config(task_layer_run.cfg, "blobs-slurm", *LISTED)
    cfg["task"] = "mytasks/blobsdep_slurm.py"
    cfg = on_cluster(cfg, slurm_cluster, nodes=2, procs=1)
    start = time.monotonic()
    tools = [Path(sys.executable).parent, Path(str(shutil.which("apptainer"))).parent]
    path = os.pathsep.join([*map(str, tools), "/usr/bin:/bin:/usr/sbin"])
    result = snakemake_slurm(slurm_cluster, w, cfg, "-p", *BUT_THE_BASE_IMAGE, env={"PATH": path})
    seconds = time.monotonic() - start
    assert result.returncode == 0, logs(w, result)
    where = where_rules_ran(result.stdout + result.stderr, task_layer_run.layer)
    assert where["prepare_data"] == where["write_config"] == "image", where
    assert "build_task_layer" not in where  # built by the local run
    prepared = (w / "logs/prepare_data/blobsdep_slurm.log").read_text()
    assert "blobsdep: 2,048 points, " in prepared and "ModuleNotFoundError" not in prepared
    record = json.loads((w / "results/blobs-slurm/export/provenance.json").read_text())
    assert record["training"]["world_size"] == 2
    assert set(record["training"]["hosts"]) == set(slurm_cluster.nodes)
    info = json.loads((w / identity.info_path(task_layer_run.layer)).read_text())
    assert record["container"]["path"] == IMAGE and record["container"]["layer"] == info
    assert record["software"]["python"] != software.stack()["python"]  # the image's
    assert record["software"]["packages"]["blobfmt"] == "1.0"  # rank 0 read it from the layer
    metrics = json.loads((w / "results/blobs-slurm/eval/metrics.json").read_text())
    assert metrics["test_count"] == 512 and metrics["test_accuracy"] >= 0.99
    print(f"SLURM run over the task's layer: {seconds:.0f} s; where each rule ran: {where}")
