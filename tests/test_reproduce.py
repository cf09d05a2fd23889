"""`ddppipe reproduce`: a finished run trained again from its record, compared, one verdict.

One finished run (tiny data, 2 epochs, 2 ranks: what the launch and export rules leave) in a
scratch working directory; each test reproduces it, or a copy of it changed afterwards.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch
import yaml

from ddppipe.apptainer import identity
from ddppipe.cli.commands import training as training_command
from ddppipe.data import batches
from ddppipe.launching import resolve
from ddppipe.reproduce import causes, checks, command, compare, plan, source, verdict
from ddppipe.runstate import origin
from ddppipe.settings import config
from ddppipe.training.loop import determinism
from ddppipe.training.tracking import provenance
from tests.conftest import run_cli
from tests.tiny import REPO, TinyData, tiny_config

STEPS_PER_EPOCH = 8  # 256 tiny training images, batches of 32
# The fast preset's learning rate on CPUs, which the tiny config keeps.
PRESET_LR = 0.006


def train_and_export(
    workdir: Path, cfg: dict[str, Any] | None, run: str, gpus: bool = False
) -> Path:
    """`ddppipe launch` then `ddppipe export` of results/<run> (its config.yaml written from
    ``cfg`` unless None: already there, resolved for GPUs with ``gpus``), as the train and
    export rules run them (the export's command function in this process: no torch to import
    again)."""
    root, data = workdir / "results" / run, workdir / "resources" / "mnist"
    if cfg is not None:
        root.mkdir(parents=True, exist_ok=True)
        with contextlib.chdir(workdir):  # (the task check's record: resources/task-checks/)
            resolve.write_resolved(cfg, root / "config.yaml", gpus=gpus)
    files = {name: root / "train" / name for name in
             ("final.pt", "metrics.jsonl", "attempts.json", "model.pt", "final.json")}  # fmt: skip
    run_cli("launch", f"--config={root / 'config.yaml'}", f"--data={data}",
            f"--state={root / 'state'}", f"--checkpoint={files['final.pt']}",
            f"--metrics={files['metrics.jsonl']}", f"--attempts={files['attempts.json']}",
            f"--log={workdir / 'logs' / run / 'train.log'}", cwd=workdir)  # fmt: skip
    with contextlib.chdir(workdir):  # `ddppipe export ...`'s function, in this process
        exported = training_command.export(
            files["model.pt"], files["final.json"], root / "config.yaml", data,
            root / "export/model.pt", root / "export/provenance.json", None, None,
            files["attempts.json"],
        )  # fmt: skip
    assert exported == 0
    return root


@pytest.fixture(scope="module")
def finished(tiny: TinyData, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A working directory with resources/mnist and the finished run results/mnist."""
    workdir = tmp_path_factory.mktemp("reproduce")
    shutil.copytree(tiny.data_dir, workdir / "resources" / "mnist")
    cfg = tiny_config(tiny, epochs=2)
    cfg["run"] = "mnist"
    train_and_export(workdir, cfg, "mnist")
    return workdir


def copied(finished: Path, to: Path) -> Path:
    """A copy of the working directory, to change (the run's state and reproductions left out)."""
    skipped = shutil.ignore_patterns("state", "tensorboard", "*-reproduced-*")
    shutil.copytree(finished, to, ignore=skipped)
    return to


def reproduce(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    return run_cli("reproduce", *args, cwd=workdir, check=False)


def last_line(result: subprocess.CompletedProcess) -> str:
    return result.stdout.strip().splitlines()[-1]


def readme_command() -> list[str]:
    """The README's `ddppipe reproduce` line, as typed (its arguments)."""
    readme = (REPO / "README.md").read_text()
    (line,) = re.findall(r"^\.venv/bin/ddppipe reproduce [^#\n]+", readme, re.M)
    return shlex.split(line)[1:]


@pytest.mark.slow  # the finished run (2 worlds), then its reproduction
def test_a_finished_run_reproduces_identical(finished: Path) -> None:
    """The README's command on the default recipe on CPUs: the same bytes, `identical`."""
    args = readme_command()
    assert args == ["reproduce", "results/mnist"]
    result = run_cli(*args, cwd=finished, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert last_line(result) == "identical"
    assert "training the reproduction in results/mnist-reproduced-1" in result.stdout
    lines = {line.split()[0]: line.split()[1] for line in result.stdout.splitlines()[1:8]}
    assert lines == {"git": "unknown", "data": "ok", "task": "ok", "config": "ok",
                     "packages": "ok", "image": "ok", "device": "ok"}  # fmt: skip
    again = finished / "results" / "mnist-reproduced-1"
    digests = {hashlib.sha256((root / "export" / "model.pt").read_bytes()).hexdigest()
               for root in (finished / "results" / "mnist", again)}  # fmt: skip
    assert len(digests) == 1  # byte-identical model.pt
    assert json.loads((again / "export" / "provenance.json").read_text())["epochs"] == 2


@pytest.mark.slow  # the finished run (2 worlds)
def test_a_changed_data_file_is_refused_before_training(finished: Path, tmp_path: Path) -> None:
    workdir = copied(finished, tmp_path / "changed")
    labels = workdir / "resources" / "mnist" / "train-labels-idx1-ubyte"
    content = bytearray(labels.read_bytes())
    content[-1] = (content[-1] + 1) % 10  # one label of another class
    labels.write_bytes(bytes(content))
    result = reproduce(workdir, "results/mnist/export/provenance.json")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "refused before training: resources/mnist/train-labels-idx1-ubyte changed since the " \
        "run trained on it" in result.stderr  # fmt: skip
    assert "training the reproduction" not in result.stdout
    assert not (workdir / "results" / "mnist-reproduced-1").exists()


@pytest.mark.slow  # a reproduction beside the finished run
def test_another_learning_rate_in_the_record_differs_from_epoch_1(
    finished: Path, tmp_path: Path
) -> None:
    """The record says the run trained at lr 0.02; its config.yaml and its numbers, at 0.006.
    (Its config.yaml also stages the data to `$TMPDIR`, as a job's would: a node-local
    setting the reproduction drops, saying so.)"""
    workdir = copied(finished, tmp_path / "other-lr")
    path = workdir / "results" / "mnist" / "export" / "provenance.json"
    record = json.loads(path.read_text())
    record["train_config"]["lr"] = 0.02
    path.write_text(json.dumps(record))
    written = yaml.safe_load((workdir / "results" / "mnist" / "config.yaml").read_text())
    written["launch"]["stage_data"] = "$TMPDIR"
    config.write(written, workdir / "results" / "mnist" / "config.yaml")
    result = reproduce(workdir, "results/mnist/export/model.pt")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "  launch.stage_data: '$TMPDIR' dropped (a node-local setting" in result.stdout
    again = yaml.safe_load((workdir / "results/mnist-reproduced-1/config.yaml").read_text())
    assert again["launch"]["stage_data"] is None
    epoch_1 = json.loads((path.parents[1] / "train" / "metrics.jsonl").read_text().split("\n")[0])
    found = re.fullmatch(r"differs from epoch 1, step 8: loss (\S+) vs (\S+); cause: (.*)",
                         last_line(result))  # fmt: skip
    assert found, last_line(result)
    assert float(found[1]) == pytest.approx(epoch_1["train_loss"], rel=1e-5)
    assert float(found[2]) != pytest.approx(epoch_1["train_loss"], rel=1e-3)
    assert found[3] == "a changed config value: train.lr 0.006 vs 0.02 (config.yaml vs record)"


@pytest.mark.slow  # the finished run, continued, reproduced
def test_a_run_continued_at_another_world_size(finished: Path, tmp_path: Path) -> None:
    """Epoch 1 on 2 ranks (its checkpoint and slot from the finished run), epoch 2 on 1:
    reproduced in one go on 2 ranks, epoch 1 agrees, epoch 2 differs, the cause named."""
    workdir = copied(finished, tmp_path / "continued")
    source, root = finished / "results" / "mnist", workdir / "results" / "continued"
    checkpoint = "ckpt-e0001-s000000"
    shutil.copytree(source / "state" / "checkpoints" / checkpoint,
                    root / "state" / "checkpoints" / checkpoint)  # fmt: skip
    (first,) = json.loads((source / "train" / "attempts.json").read_text())
    first.update(outcome="time limit", end_step=STEPS_PER_EPOCH, checkpoint=checkpoint)
    (root / "state" / "attempts.json").write_text(json.dumps([first]))
    cfg = yaml.safe_load((source / "config.yaml").read_text())
    cfg["run"], cfg["launch"]["nproc_per_node"] = "continued", 1
    config.write(cfg, root / "config.yaml")
    train_and_export(workdir, None, "continued")
    history = json.loads((root / "train" / "attempts.json").read_text())
    assert [(a["world_size"], a["start_step"]) for a in history] == [(2, 0), (1, 8)]

    result = reproduce(workdir, "results/continued")
    metrics = workdir / "results" / "continued-reproduced-1" / "train" / "metrics.jsonl"
    again = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [m["world_size"] for m in again] == [2, 2]
    # BatchNorm's statistics of 16 images a rank against 32 from epoch 2: never the same
    assert result.returncode == 1, result.stdout + result.stderr
    assert re.fullmatch(
        r"differs from epoch 2, step 16: loss \S+ vs \S+; cause: the run changed world size "
        r"\(2 -> 1 ranks at step 8\): each rank's share of the batch \(its BatchNorm "
        r"statistics\) and the all-reduce's order changed there", last_line(result),
    ), result.stdout  # fmt: skip


def test_the_git_check_names_what_differs_from_the_recorded_commit(tmp_path: Path) -> None:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True,
                              text=True).stdout.strip()  # fmt: skip

    git("init", "-q")
    (tmp_path / "train.py").write_text("lr = 1\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    commit = git("rev-parse", "HEAD")
    same = checks.git({"commit": commit, "dirty": False}, tmp_path)
    assert (same.status, same.text) == ("ok", f"this tree is commit {commit[:12]}'s")
    (tmp_path / "train.py").write_text("lr = 2\n")
    edited = checks.git({"commit": commit, "dirty": False}, tmp_path)
    assert edited.text == f"this tree differs from commit {commit[:12]} in train.py"
    gone = checks.git({"commit": "0" * 40, "dirty": False}, tmp_path)
    assert gone.text == "commit 000000000000 is not in this repository (fetch it, then " \
        "`git checkout 000000000000`)"  # fmt: skip


def test_a_reproduction_whose_cpu_decides_another_precision_names_it() -> None:
    """A run whose precision auto trained bf16 on CPUs with AVX512-BF16, reproduced on a CPU
    that only emulates it: the check before training and the causes after it say so."""
    bf16 = {"configured": "auto", "trained": "bf16", "bf16_native": True, "emulating": []}
    fp32 = {"configured": "auto", "trained": "fp32", "bf16_native": False, "emulating": ["b"]}
    training = {"device": "cpu", "device_name": "cpu", "precision": bf16}
    here = ("cpu", "cpu", "AMD EPYC")
    assert checks.device(training, "AMD EPYC", here, "bf16").status == "ok"
    found = checks.device(training, "AMD EPYC", here, "fp32")
    assert (found.status, found.text) == ("differs", (
        "the run trained on cpu (cpu, CPU AMD EPYC), this machine on cpu (cpu, CPU AMD EPYC); "
        "train.precision auto trained in bf16 there and trains in fp32 here (bf16 only where "
        "the device computes it natively)"))  # fmt: skip
    run, again = {"training": training}, {"training": {**training, "precision": fp32}}
    assert causes.precision(run, again) == [
        "another precision (bf16 vs fp32: train.precision auto is bf16 only where every rank's "
        "device computes bfloat16 natively)"
    ]
    assert causes.precision(run, run) == []
    written = {"precision": "auto", "lr": 0.006}  # config.yaml's; the record's: as decided
    assert checks.config({"precision": "fp32", "lr": 0.006}, {"train": written}).status == "ok"
    assert checks.config({"precision": "fp32", "lr": 0.01}, {"train": written}).status == \
        "differs"  # fmt: skip


def test_the_verdict_of_weights_that_differ_only_at_the_end() -> None:
    found = compare.Comparison([compare.TensorDiff("fc.weight", 2.5e-7)], None, [])
    line = verdict.line(found, ["non-deterministic kernels (a GPU run without "
                                "train.deterministic: true)"], 8)  # fmt: skip
    assert line == ("differs in the final weights only: 1 tensors, largest difference 2.5e-07 "
                    "in fc.weight; cause: non-deterministic kernels (a GPU run without "
                    "train.deterministic: true)")  # fmt: skip


def test_deterministic_mode_keeps_the_default_identity_and_names_a_refused_op() -> None:
    """`train.deterministic: false` (the default) leaves the default identity as it is; true
    is another identity. An op torch refuses is named. (The hashes are the same on every CPU:
    the fast preset's precision is auto, decided where the ranks start.)"""
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    default = config.resolve(cfg, gpus=False)
    assert default["train"]["deterministic"] is False
    assert config.train_hash(default, "0123456789abcdef") == "741662e548142bf1"
    cfg["train"]["deterministic"] = True
    assert config.train_hash(config.resolve(cfg, gpus=False), "0123456789abcdef") == \
        "89fb125f6c0c8f75"  # fmt: skip
    refused = RuntimeError(
        "adaptive_max_pool2d_backward_cuda does not have a deterministic implementation, but "
        "you set 'torch.use_deterministic_algorithms(True)'."
    )
    error = determinism.explained(refused)
    assert isinstance(error, determinism.NoDeterministicKernel)
    assert str(error).startswith("train.deterministic: the op adaptive_max_pool2d_backward_cuda "
                                 "has no deterministic kernel on this device")  # fmt: skip
    other = ValueError("no")
    assert determinism.explained(other) is other


def test_an_epoch_resumed_inside_compares_all_but_its_train_loss(tmp_path: Path) -> None:
    """A slot that resumed at step 10 of epoch 1 (100 steps an epoch) averaged its loss over
    steps 11-100 only: epoch 1's train_loss is not compared, its test loss is."""
    attempts = [{"world_size": 2, "start_step": 0, "end_step": 10},
                {"world_size": 2, "start_step": 10, "end_step": 200}]  # fmt: skip
    record = {"epochs": 2, "attempts": attempts, "train_config": {}}
    run = source.Recorded(tmp_path, record, None, [], None, tmp_path / "model.pt")
    assert (run.steps_per_epoch, run.split_epochs) == (100, {1})
    slots = [{"epoch": 1, "train_loss": 1.33, "test_loss": 1.26},
             {"epoch": 2, "train_loss": 0.66, "test_loss": 0.18}]  # fmt: skip
    again = [{**slots[0], "train_loss": 1.37}, slots[1]]
    assert compare.epochs(slots, again, run.split_epochs) is None
    assert compare.epochs(slots, again) == compare.EpochDiff(1, "train_loss", 1.33, 1.37)
    later = [again[0], {**slots[1], "test_loss": 0.19}]
    assert compare.epochs(slots, later, run.split_epochs) == compare.EpochDiff(
        2, "test_loss", 0.18, 0.19
    )


class RandomItems(torch.utils.data.Dataset):
    """Items drawn in the DataLoader's worker: a random transform's streams."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.tensor([torch.rand(()).item(), random.random(), numpy.random.rand()]), index


def test_deterministic_mode_seeds_the_loader_workers() -> None:
    """`train.deterministic`: a worker's torch, random and NumPy draws are the same in every
    run (of the same seed, epoch and rank); without it, torch's differ."""

    def drawn(seeded: bool, seed: int = 0) -> torch.Tensor:
        feed = batches.Feed(RandomItems(), torch.device("cpu"), workers=1, seeded=seeded)
        return torch.cat([s.batch[0] for s in feed.epoch(seed, 0, 4, 0, 1, 0)])

    assert torch.equal(drawn(True), drawn(True))
    assert not torch.equal(drawn(True), drawn(True, seed=1))
    assert not torch.equal(drawn(False)[:, 0], drawn(False)[:, 0])


def test_the_provenance_names_the_commit_the_training_started_from(
    finished: Path, tmp_path: Path
) -> None:
    """Epoch 1 trained in a slot started at commit A (its record: the finished run's slot,
    with the origin that launcher takes in this tree), commit B made while it was held,
    epoch 2 in a second slot: the second slot names the change, the provenance says A."""
    workdir = copied(finished, tmp_path / "committed")

    def git(*args: str) -> str:
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                              cwd=workdir, check=True, capture_output=True,
                              text=True).stdout.strip()  # fmt: skip

    git("init", "-q")
    (workdir / ".gitignore").write_text("results/\nresources/\nlogs/\n")
    (workdir / "notes.py").write_text("lr = 0.006\n")
    git("add", ".")
    git("commit", "-qm", "A")
    a = git("rev-parse", "HEAD")
    data = workdir / "resources" / "mnist"
    taken = origin.taken(data, workdir)
    assert taken == {
        "git": {"commit": a, "dirty": False},
        "data": json.loads((data / "manifest.json").read_text())["digest"],
    }
    source, root = finished / "results" / "mnist", workdir / "results" / "committed"
    checkpoint = "ckpt-e0001-s000000"
    shutil.copytree(source / "state" / "checkpoints" / checkpoint,
                    root / "state" / "checkpoints" / checkpoint)  # fmt: skip
    (first,) = json.loads((source / "train" / "attempts.json").read_text())
    first.update(outcome="time limit", end_step=STEPS_PER_EPOCH, checkpoint=checkpoint,
                 origin=taken)  # fmt: skip
    (root / "state" / "attempts.json").write_text(json.dumps([first]))
    cfg = yaml.safe_load((source / "config.yaml").read_text())
    cfg["run"] = "committed"
    config.write(cfg, root / "config.yaml")
    (workdir / "notes.py").write_text("lr = 0.01\n")
    git("commit", "-qam", "B")  # while the run waits for its next slot
    b = git("rev-parse", "HEAD")

    train_and_export(workdir, None, "committed")
    change = f"the code changed since the first slot: commit {a[:12]} -> {b[:12]}"
    history = json.loads((root / "train" / "attempts.json").read_text())
    assert [(h["start_step"], h["origin"]["git"]["commit"]) for h in history] == [(0, a), (8, b)]
    assert history[1]["detail"] == change
    assert change in (root / "state" / "train.log").read_text()
    record = json.loads((root / "export" / "provenance.json").read_text())
    assert record["git"] == {"commit": a, "dirty": False}
    assert record["data_sha256"] == json.loads((source / "export" / "provenance.json")
                                               .read_text())["data_sha256"]  # fmt: skip


def test_a_later_slot_names_changed_data_and_a_dirty_tree() -> None:
    was = {"git": {"commit": "a" * 40, "dirty": False}, "data": "d1"}
    now = {"git": {"commit": "a" * 40, "dirty": True}, "data": "d2"}
    assert origin.changes(was, now, 3) == [
        "the code changed since slot 3 (where the training started): the tree of commit "
        "aaaaaaaaaaaa has uncommitted changes now",
        "the data changed since slot 3 (where the training started): manifest digest d1 -> d2 "
        "(its checkpoints are of other data: training starts again)",
    ]
    assert origin.changes(was, was, 1) == []
    # the slot the final training started in: the last that started at step 0
    history = [{"number": 1, "start_step": 0, "origin": was},
               {"number": 2, "start_step": 8, "origin": was},
               {"number": 3, "start_step": 0, "origin": now},
               {"number": 4, "start_step": None, "origin": None}]  # fmt: skip
    assert origin.started(history) == (3, now)
    assert origin.started([{"number": 1, "start_step": None, "origin": None}]) is None


def test_a_container_runs_packages_are_compared_with_its_images(tmp_path: Path) -> None:
    """The record's packages are those rank 0 saw in the image; the host's venv is another
    environment: the image's labels are what the reproduction trains with."""
    image = tmp_path / "ddppipe.sif"
    image.write_bytes(b"an image")
    recorded = {"torch": "2.9.1", "numpy": "2.3.0", "not-on-this-host": "1.0"}
    labels = {identity.PACKAGES: "torch==2.9.1 numpy==2.3.0 Not-On-This-Host==1.0"}
    container = {"path": str(image), "sha256": identity.sha256(image), "labels": labels}
    record = {"software": {"packages": recorded}, "container": container}
    same = checks.image(container)
    assert same.status == "ok"
    found = command._packages(record, same)
    assert (found.status, found.text) == ("ok", f"3 distributions as recorded (the image "
                                                f"{image}'s)")  # fmt: skip
    assert command._packages({**record, "container": None}, same).text.startswith(
        "recorded -> installed: "
    )  # the same record against this venv: a false difference the image check avoids
    rebuilt = checks.Finding("image", "differs", "rebuilt since")
    now = {identity.PACKAGES: "torch==2.9.1 numpy==2.3.0 not-on-this-host==1.0"}
    found = checks.image_packages(recorded, container, rebuilt, now)
    assert (found.status, found.text) == ("ok", f"3 distributions as recorded (the image "
                                                f"{image}'s)")  # fmt: skip
    # a task's layer (container.requirements) over the image: what it installs over its labels
    task_layer = tmp_path / "ddppipe-0123456789ab.layer.sqfs"
    task_layer.write_bytes(b"a layer")
    with_layer = {**container, "layer": {"path": str(task_layer), "requirements": ["a==1"],
                                         "sha256": identity.sha256(task_layer),
                                         "installed": ["numpy==2.3.0"]}}  # fmt: skip
    assert checks.image(with_layer) == checks.Finding("image", "ok", (
        f"{image}: SHA-256 {identity.sha256(image)[:12]} as recorded, its task layer "
        f"{task_layer}: SHA-256 {identity.sha256(task_layer)[:12]} as recorded"))  # fmt: skip
    found = checks.image_packages(recorded, with_layer, rebuilt, now, ["numpy==2.3.1"])
    assert (found.status, found.text) == (
        "differs",
        f"recorded -> the image {image}'s with its task layer: numpy 2.3.0 -> 2.3.1",
    )
    task_layer.write_bytes(b"another layer")
    assert checks.image(with_layer).text == (
        f"its task layer {task_layer}: SHA-256 {identity.sha256(task_layer)[:12]}, the run's "
        f"{with_layer['layer']['sha256'][:12]} (rebuilt since)"
    )
    task_layer.unlink()
    assert checks.image(with_layer).text == (
        f"its task layer {task_layer} (SHA-256 {with_layer['layer']['sha256'][:12]}) is not "
        "here: rule build_task_layer builds it again from container.requirements a==1, or copy it"
    )
    older = {**container, "labels": {}}  # built before the packages were a label
    assert checks.image_packages(recorded, older, same, None).status == "ok"
    assert checks.image_packages(recorded, older, rebuilt, {}).status == "unknown"


def test_node_local_settings_are_dropped_from_the_reproduction(
    finished: Path, tmp_path: Path
) -> None:
    """`launch.stage_data: $TMPDIR` (set inside a job only) names where the run trained, not
    what: the reproduction reads the data where it is, and says so."""
    workdir = copied(finished, tmp_path / "staged")
    path = workdir / "results" / "mnist" / "config.yaml"
    cfg = yaml.safe_load(path.read_text())
    cfg["launch"]["stage_data"] = "$TMPDIR"
    config.write(cfg, path)
    run = source.find(workdir / "results" / "mnist")
    again = plan.config(run, "mnist-reproduced-1", gpu=False)
    assert again["launch"]["stage_data"] is None
    assert plan.dropped(run) == [
        "launch.stage_data: '$TMPDIR' dropped (a node-local setting of where the run trained; "
        "it changes no number): the reproduction reads the data where it is"
    ]
    assert again["trial"] is None and plan.pruned_at(run) is None


def test_a_script_run_is_refused_with_what_to_do_instead(tmp_path: Path) -> None:
    export = tmp_path / "results" / "own" / "export"
    export.mkdir(parents=True)
    record = {"git": {"commit": "c" * 40, "dirty": False}, "script": {"path": "train.py"},
              "outputs_sha256": {"model.pt": "0" * 64}}  # fmt: skip
    (export / "provenance.json").write_text(json.dumps(record))
    result = reproduce(tmp_path, "results/own")
    assert result.returncode == 2, result.stdout + result.stderr
    assert (
        "results/own/export/provenance.json: the record of a script run (train.py); ddppipe "
        "reproduce trains task runs only: a script trains with its own code, whose weights and "
        "per-epoch numbers ddppipe does not know, so it cannot train it to a comparable end. To "
        "run it again, check out commit cccccccccccc (the record's git), copy the run's "
        "config.yaml under another run name and run it (snakemake, or ddppipe launch), then "
        "compare its export/outputs with the record's outputs_sha256"
    ) in result.stderr


def test_the_export_refuses_data_prepared_again_since_the_training_started(
    tiny: TinyData,
) -> None:
    """The record would name files that did not train: refused, with what to do."""
    found = provenance.data_checksums(tiny.data_dir, digest=None)
    assert found == tiny.sha256
    digest = json.loads((tiny.data_dir / "manifest.json").read_text())["digest"]
    assert provenance.data_checksums(tiny.data_dir, digest) == tiny.sha256
    with pytest.raises(provenance.DataChanged) as e:
        provenance.data_checksums(tiny.data_dir, "0123456789abcdef")
    assert str(e.value) == (
        f"{tiny.data_dir}: its manifest's digest is {digest}, the training started on data of "
        "digest 0123456789abcdef: the data was prepared again since. The provenance would name "
        "other data than trained: restore the data the run trained on, or train the run again "
        "on this data"
    )
