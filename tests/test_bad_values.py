"""Values the schema accepts but a run cannot use: rejected before anything is submitted or
started, with a message naming the key and the fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from ddppipe.launching import launch
from ddppipe.settings import config
from ddppipe.settings import run_spec as run_spec
from ddppipe.slurm import request as slurm_request
from tests.conftest import run_cli
from tests.tiny import default_config


def setting(section: str, **values: Any) -> Callable[[dict], None]:
    return lambda cfg: cfg[section].update(values)


CASES = [
    ("signal during start-up", setting("slurm", runtime=1, signal_seconds=60),
     slurm_request.SlurmRequestError,
     "slurm.signal_seconds (60) must be shorter than slurm.runtime"),
    ("GPUs in the old key", setting("slurm", gpus_per_node=4), config.ConfigError,
     "slurm.gpus_per_node: this key is now launch.device"),
    ("backend in the old key", setting("launch", backend="nccl"), config.ConfigError,
     "launch.backend: this key is now launch.device"),
    ("batch not divisible", lambda c: (c["launch"].update(nnodes=3), c["train"].update(
        batch_size=64)), config.ConfigError, "divisible by the world size 6"),
    ("renamed key", setting("slurm", cpus_per_task=2), config.ConfigError,
     "slurm.cpus_per_task: this key is now launch.cpus_per_proc"),
    ("unpinned requirement", setting("container", requirements=["tabulate"]), config.ConfigError,
     "$': The task's own pip packages, each pinned as name==version"),
    ("text that is no number", setting("launch", nnodes="two"), config.ConfigError,
     "'two' is not of type 'integer' (command-line values are text)"),
    ("negative continuations", setting("slurm", max_continuations=-1), config.ConfigError,
     "slurm.max_continuations"),
    ("unknown cluster check", setting("slurm", cluster_check="ignore"), config.ConfigError,
     "slurm.cluster_check"),
    ("too little memory for GPUs", lambda c: (c["launch"].update(nproc_per_node=4, device="gpu"),
     c["slurm"].update(mem_mb=8000)), slurm_request.SlurmRequestError,
     "slurm.mem_mb (8000) is too little for 4 GPU processes per node: each needs at least 4000"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "change", "error", "message"), CASES, ids=[c[0] for c in CASES])
def test_bad_value_is_rejected_with_its_key(
    name: str, change: Callable, error: type, message: str
) -> None:
    cfg = default_config()
    change(cfg)
    with pytest.raises(error) as e:
        gpus = cfg["launch"]["device"] == "gpu"  # as the config asks: the case's point
        slurm_request.Request.from_spec(run_spec.resolve(cfg, gpus=gpus))
    assert message in str(e.value)


def request(rendezvous_host: str | None) -> slurm_request.Request:
    cfg = default_config()
    cfg["slurm"]["rendezvous_host"] = rendezvous_host
    return slurm_request.Request.from_spec(run_spec.resolve(cfg, gpus=False))


def test_rendezvous_host_outside_the_allocation() -> None:
    with pytest.raises(slurm_request.SlurmRequestError, match="is none of this job's nodes"):
        request("127.0.0.2").check_rendezvous_host(["127.0.0.1"])
    request("localhost").check_rendezvous_host(["127.0.0.1"])  # another name of a node: fine
    request(None).check_rendezvous_host(["127.0.0.1"])


def test_several_nodes_without_slurm() -> None:
    cfg = default_config()
    cfg["launch"]["nnodes"] = 2
    with pytest.raises(config.ConfigError, match="no SLURM allocation"):
        launch.plan(run_spec.resolve(cfg, gpus=False), ["train"], [], env={})


@pytest.mark.parametrize("command", ["launch", "train"])
def test_an_unresolved_config_is_a_clear_error(command: str, tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(default_config()))  # batch_size & co. still null
    paths = [f"--data={tmp_path}", f"--state={tmp_path}/s", f"--checkpoint={tmp_path}/f.pt",
             f"--metrics={tmp_path}/m"]  # fmt: skip
    result = run_cli(command, f"--config={path}", *paths, check=False)
    assert result.returncode == 2
    assert "this config was never resolved" in result.stderr and "resolve-config" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("command", "text", "message"),
    [("resolve-config", "{run: x}", "--json: not JSON text (Expecting property name"),
     ("data-settings", "[1]", "--json: expected a JSON object, got list")],
)  # fmt: skip
def test_config_json_that_is_no_object_writes_nothing(
    command: str, text: str, message: str, tmp_path: Path
) -> None:
    out = tmp_path / "out.yaml"
    result = run_cli(command, f"--json={text}", f"--out={out}", check=False)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not out.exists()


COUNTED_TASK = '''\
"""A task whose model() counts its builds (the test's file), slowly."""
import os
import time

from torch import nn


def prepare(data_dir, args):
    raise NotImplementedError


def datasets(data_dir, args):
    raise NotImplementedError


def model(args):
    with open(os.environ["BUILDS"], "a") as f:
        f.write("built\\n")
    time.sleep(1.0)
    return nn.Linear(4, 2)
'''


def test_write_configs_that_start_together_check_the_task_once(tmp_path: Path) -> None:
    """A sweep's write_configs start together: the first builds the task's model, the others
    wait for its check and keep it (one build, not one each beside it)."""
    (tmp_path / "counted.py").write_text(COUNTED_TASK)
    env = {**os.environ, "BUILDS": str(tmp_path / "builds")}
    procs = []
    for k in range(3):
        cfg = default_config()
        cfg.update(run=f"r{k}", task="counted.py", task_args={})
        command = [sys.executable, "-m", "ddppipe", "resolve-config", "--json", json.dumps(cfg),
                   "--gpus", "no", "--out", str(tmp_path / f"r{k}.yaml")]  # fmt: skip
        procs.append(subprocess.Popen(command, cwd=tmp_path, env=env, stderr=subprocess.PIPE,
                                      text=True))  # fmt: skip
    logs = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], logs
    assert (tmp_path / "builds").read_text() == "built\n"
    assert sum("checked before" in log for log in logs) == 2, logs
