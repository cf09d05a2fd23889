"""The run spec (ddppipe.settings.run_spec): the resolved config as frozen dataclasses,
validated once per process of a slot."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from ddppipe.settings import config, run_spec
from tests.conftest import run_cli
from tests.tiny import REPO, TinyData, default_config, tiny_config


def test_every_schema_key_has_its_typed_field() -> None:
    """The spec's sections and the schema cannot drift apart: a key added to one only fails."""
    properties = config.schema()["properties"]
    for name, section in run_spec.SECTIONS.items():
        fields = {f.name for f in dataclasses.fields(section)}
        assert fields == set(properties[name]["properties"]), name
    top = (
        {f.name for f in dataclasses.fields(run_spec.RunSpec)}
        - set(run_spec.SECTIONS)
        - {"_config"}
    )
    assert set(properties["resolved"]["properties"]) == {"device"}  # resolved.device: .device
    assert top == set(properties) - set(run_spec.SECTIONS) - {"resolved"} | {"device"}


def test_a_spec_is_frozen_and_answers_what_was_decided() -> None:
    cfg = default_config()
    cfg["launch"].update(nnodes=2, nproc_per_node=4, device="gpu")
    spec = run_spec.resolve(cfg, gpus=True)
    assert (spec.device, spec.gpus, spec.world_size, spec.kind) == ("gpu", True, 8, "task")
    assert spec.train.preset == "gpu" and spec.train.batch_size == 256  # the GPU recipe
    assert spec.slurm.runtime == 30 and spec.container.mode == "none"  # schema defaults
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.train.lr = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        spec.task_args["batchnorm"] = False  # type: ignore[index]
    assert spec.as_dict()["resolved"] == {"device": "gpu"}
    assert spec.as_dict()["task_args"] == {"batchnorm": True}


def test_auto_is_decided_where_the_run_is_resolved() -> None:
    cfg = default_config()  # launch.device: auto
    assert run_spec.resolve(cfg, gpus=False).device == "cpu"
    gpu = run_spec.resolve(cfg, gpus=True)
    assert (gpu.device, gpu.launch.device, gpu.train.preset) == ("gpu", "auto", "gpu")


def test_one_validation_per_process_of_a_slot(tiny: TinyData, tmp_path: Path) -> None:
    """A local slot of 2 ranks: the launcher and each rank validate the config once, and no
    other process of the slot validates it at all."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    path = run_dir / "config.yaml"
    config.write(config.resolve(tiny_config(tiny, epochs=1), gpus=False), path)
    counts = tmp_path / "validations"
    counts.mkdir()
    pythonpath = os.pathsep.join([str(REPO / "tests" / "count_validations"),
                                  os.environ.get("PYTHONPATH", "")])  # fmt: skip
    run_cli(
        "launch", f"--config={path}", f"--data={tiny.data_dir}", f"--state={run_dir / 'state'}",
        f"--checkpoint={run_dir / 'final.pt'}", f"--metrics={run_dir / 'metrics.jsonl'}",
        env={"PYTHONPATH": pythonpath, "DDPPIPE_TEST_VALIDATIONS": str(counts)},
    )  # fmt: skip
    assert (run_dir / "final.pt").exists()
    calls = sorted(f.read_text().splitlines() for f in counts.iterdir())
    launcher = [c for c in calls if " launch " in f" {c[0]} "]
    ranks = [c for c in calls if " train " in f" {c[0]} "]
    assert len(launcher) == 1 and len(ranks) == 2 and len(calls) == 3, calls
    assert all(len(c) == 1 for c in calls), calls  # once in each process


def test_each_run_is_resolved_once_per_snakemake_call(tmp_path: Path) -> None:
    """A dry run of a 3-trial sweep on the SLURM profile: the Snakemake process resolves each
    run once (its device decided, its preset applied: RUNS.spec), and that one spec gives its
    request, threads, image check and write_config's device."""
    from tests.workflow_helpers import snakemake

    cfg = default_config()
    cfg["sweep"] = {"name": "lr", "parameters": {"train.lr": [0.01, 0.02, 0.03]}}
    counts = tmp_path / "resolves"
    counts.mkdir()
    pythonpath = os.pathsep.join([str(REPO / "tests" / "count_validations"),
                                  os.environ.get("PYTHONPATH", "")])  # fmt: skip
    env = {"PYTHONPATH": pythonpath, "DDPPIPE_TEST_RESOLVES": str(counts)}
    snakemake(tmp_path / "wd", cfg, "-n", "--profile", str(REPO / "profiles/slurm"), "sweep",
              env=env)  # fmt: skip
    (process,) = [f.read_text().splitlines() for f in counts.iterdir()]
    trials = [f"sweeps/lr/lr={lr}" for lr in (0.01, 0.02, 0.03)]
    assert sorted(process) == sorted(["mnist", *trials]), process
