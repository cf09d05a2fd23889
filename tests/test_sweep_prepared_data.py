"""Sweeps of keys that a task's prepare() reads, locally: each trial trains on data prepared
for its own values (ddppipe.settings.data_sets); and trials trained under the names of before
(keys joined by ``,``) are renamed once and not trained again (ddppipe.sweeps.legacy_names).

Two sweeps side by side, each of two keys: the digits task's ``test_fraction`` (it declares
``PREPARE_ARGS``), and a task file written for the tests, tests/data/blobs.py without its
``PREPARE_ARGS`` (every argument counts), over ``samples``.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.test_sweep import jobs, user_dir
from tests.tiny import default_config
from tests.workflow_helpers import snakemake

pytestmark = pytest.mark.slow  # end-to-end sweeps through the DAG (about 20 s)


def one_epoch(cfg: dict[str, Any]) -> dict[str, Any]:
    cfg["tracking"]["tensorboard"] = False
    cfg["train"].update({"epochs": 1, "batch_size": 32, "eval_batch_size": 64, "lr": 0.05})
    cfg["launch"].update({"nproc_per_node": 1, "device": "cpu", "cpus_per_proc": 1})
    return cfg


def digits_config() -> dict[str, Any]:
    cfg = one_epoch(default_config())
    cfg.update(run="digits", task="ddppipe.tasks.digits", task_args={"width": 8})
    cfg["sweep"] = {"name": "split", "parameters": {"task_args.test_fraction": [0.2, 0.4],
                                                    "train.lr": [0.05]}}  # fmt: skip
    return cfg


def blobs_config() -> dict[str, Any]:
    cfg = one_epoch(default_config())
    cfg.update(run="blobs", task="tasks/blobs.py", task_args={"samples": 256})
    cfg["sweep"] = {"name": "size", "parameters": {"task_args.hidden": [4],
                                                   "task_args.samples": [64, 128]}}  # fmt: skip
    return cfg


@pytest.fixture(scope="module")
def calls(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Both sweeps, side by side (one core each)."""
    digits = tmp_path_factory.mktemp("split")
    blobs = user_dir(tmp_path_factory.mktemp("size") / "wd")
    task = blobs / "tasks" / "blobs.py"
    task.write_text(re.sub(r"^PREPARE_ARGS = .*\n", "", task.read_text(), flags=re.M))
    out: dict[str, subprocess.CompletedProcess] = {}

    def call(name: str, workdir: Path, cfg: dict[str, Any]) -> None:
        out[name] = snakemake(workdir, cfg, "--cores", "1", "sweep", check=False)

    threads = [threading.Thread(target=call, args=("digits", digits, digits_config())),
               threading.Thread(target=call, args=("blobs", blobs, blobs_config()))]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name, result in out.items():
        assert result.returncode == 0, (name, result.stderr[-6000:])
    return {"digits": digits, "blobs": blobs, **{f"{k}_result": v for k, v in out.items()}}


def evaluation(workdir: Path, run: str) -> dict[str, Any]:
    return json.loads((workdir / "results" / run / "eval" / "metrics.json").read_text())


def test_each_trial_of_a_split_sweep_trains_on_its_own_split(calls: dict) -> None:
    """Each class contributes round(n * test_fraction) of its images to the test set: 359 of
    the 1,797 images at 0.2, 719 at 0.4 (450 at the default 0.25)."""
    wd = calls["digits"]
    counts = {f: evaluation(wd, f"sweeps/split/test_fraction={f}+lr=0.05")["test_count"]
              for f in (0.2, 0.4)}  # fmt: skip
    assert counts == {0.2: 359, 0.4: 719}
    prepared = {p.parent.name for p in (wd / "resources").glob("*/manifest.json")}
    assert prepared == {"digits+test_fraction=0.2", "digits+test_fraction=0.4"}
    assert jobs(calls["digits_result"], "train") == [
        "sweeps/split/test_fraction=0.2+lr=0.05", "sweeps/split/test_fraction=0.4+lr=0.05"
    ]  # fmt: skip


def test_a_task_file_without_prepare_args_gets_data_for_each_task_args(calls: dict) -> None:
    """blobs.py declares no PREPARE_ARGS: every task_args value counts; its test set is the
    last quarter of its samples."""
    wd = calls["blobs"]
    counts = {n: evaluation(wd, f"sweeps/size/hidden=4+samples={n}")["test_count"]
              for n in (64, 128)}  # fmt: skip
    assert counts == {64: 16, 128: 32}
    prepared = {p.parent.name for p in (wd / "resources").glob("*/manifest.json")}
    assert prepared == {"blobs+hidden=4+samples=64", "blobs+hidden=4+samples=128"}


def test_trials_under_their_names_of_before_are_renamed_and_not_trained_again(
    calls: dict, tmp_path: Path
) -> None:
    """The finished sweep as an earlier ddppipe left it: a trial's folders named with ``,``, and
    Snakemake's records of its files under those names. A dry run renames the trial and has
    nothing to train."""
    wd = tmp_path / "wd"
    shutil.copytree(calls["blobs"], wd, symlinks=True)
    old, new = "hidden=4,samples=64", "hidden=4+samples=64"
    for record in (wd / ".snakemake" / "metadata").iterdir():  # named by their paths, base64
        path = base64.urlsafe_b64decode(record.name + "=" * (-len(record.name) % 4)).decode()
        if f"/{new}/" in path:
            record.rename(record.with_name(base64.urlsafe_b64encode(
                path.replace(new, old).encode()).decode()))  # fmt: skip
    for top in ("results", "logs", "benchmarks"):
        folder = wd / top / "sweeps" / "size"
        (folder / new).rename(folder / old)
    config = wd / "results/sweeps/size" / old / "config.yaml"
    config.write_text(config.read_text().replace(new, old))
    os.utime(config, ns=(0, (wd / f"results/sweeps/size/{old}/state").stat().st_mtime_ns))
    stamp = config.stat().st_mtime_ns
    result = snakemake(wd, blobs_config(), "-n", "--cores", "1", "sweep")
    output = result.stdout + result.stderr
    assert f"renamed trial sweeps/size/{old} to sweeps/size/{new}" in output, output[-4000:]
    assert jobs(result, "train") == [] and "Nothing to be done" in output, output[-4000:]
    for top in ("results", "logs", "benchmarks"):
        found = (p.name for p in (wd / top / "sweeps/size").iterdir() if p.name.startswith("hid"))
        assert set(found) == {new, "hidden=4+samples=128"}, top
    renamed = wd / "results/sweeps/size" / new / "config.yaml"
    assert f"run: sweeps/size/{new}" in renamed.read_text()
    assert f"name: {new}" in renamed.read_text() and renamed.stat().st_mtime_ns == stamp
