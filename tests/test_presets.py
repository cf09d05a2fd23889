"""The training presets: complete recipes, chosen for the device, and each trains for real on
tiny data."""

from __future__ import annotations

import json
import logging
import math
import socket
from pathlib import Path
from typing import Any

import pytest
import torch

from ddppipe.core import system
from ddppipe.launching import resolve
from ddppipe.parallel import devices, precision
from ddppipe.runstate import attempts
from ddppipe.settings import config, presets, run_spec
from tests.conftest import run_cli
from tests.tiny import REPO, TinyData, default_config, fast_cpu_precision, tiny_config


def launch(cfg: dict[str, Any], tiny: TinyData, run_dir: Path) -> None:
    """Resolve ``cfg`` into ``run_dir`` and train with ``ddppipe launch`` (torchrun)."""
    config.write(config.resolve(cfg, gpus=False), run_dir / "config.yaml")
    run_cli(
        "launch",
        f"--config={run_dir / 'config.yaml'}",
        f"--data={tiny.data_dir}",
        f"--state={run_dir / 'state'}",
        f"--checkpoint={run_dir / 'final.pt'}",
        f"--metrics={run_dir / 'metrics.jsonl'}",
    )


@pytest.mark.parametrize("name", sorted(presets.PRESETS))
def test_every_preset_sets_every_recipe_key(name: str) -> None:
    assert set(presets.PRESETS[name]) == set(presets.RECIPE_KEYS)


def test_fast_preset_is_the_default_and_divides_by_common_world_sizes() -> None:
    train = config.resolve(default_config(), gpus=False)["train"]
    assert train["preset"] == "fast"
    for world_size in (1, 2, 4, 8):
        assert train["batch_size"] % world_size == 0


def test_reference_preset_is_the_classic_recipe() -> None:
    cfg = default_config()
    cfg["train"]["preset"] = "reference"
    train = config.resolve(cfg, gpus=False)["train"]
    assert (train["optimizer"], train["lr"], train["schedule"], train["gamma"]) == (
        "adadelta",
        1.0,
        "step",
        0.7,
    )
    assert (train["epochs"], train["batch_size"], train["precision"]) == (14, 128, "fp32")


# The flags lines of /proc/cpuinfo on three kinds of machine (shortened).
EPYC_AVX2 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx avx2 fma bmi2\n"
XEON_AMX = "processor\t: 0\nflags\t\t: avx2 avx512f avx512_vnni amx_bf16 amx_tile amx_int8\n"
GENOA = "flags\t\t: avx2 avx512f avx512_bf16 avx512_vnni\n"
GRACE = "processor\t: 0\nBogoMIPS\t: 2000.00\nFeatures\t: fp asimd sve sve2 i8mm bf16 svebf16\n"
GRAVITON2 = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics\n"


@pytest.mark.parametrize(("cpuinfo", "native"), [
    (EPYC_AVX2, False), (XEON_AMX, True), (GENOA, True), (GRACE, True), (GRAVITON2, False),
    (None, False),  # no /proc/cpuinfo (macOS)
])  # fmt: skip
def test_native_bf16_read_from_the_cpu_flags(
    cpuinfo: str | None, native: bool, tmp_path: Path
) -> None:
    path = tmp_path / "cpuinfo"
    if cpuinfo is not None:
        path.write_text(cpuinfo)
    assert system.cpu_computes_bf16(path) is native


# /proc/cpuinfo's first processor of two kinds of machine: an AMD EPYC 7763 (Zen 3, AVX2
# only: it emulates bfloat16) and an AMD EPYC of Zen 4 (AVX512-BF16).
MILAN, GENOA = (Path(__file__).parent / "data" / f"cpuinfo-epyc-{kind}.txt"
                for kind in ("milan", "genoa"))  # fmt: skip
DEFAULT_HASH = "741662e548142bf1"  # the default config's, data digest 0123456789abcdef


def test_the_default_identity_does_not_depend_on_the_resolving_machines_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The config resolved on a login node with native bf16 and on one without is one run:
    the fast preset's precision is auto there, decided where the ranks start."""
    hashes = {}
    for cpuinfo, native in ((MILAN, False), (GENOA, True)):
        monkeypatch.setattr(system, "CPUINFO", cpuinfo)  # the resolving machine's CPU
        assert system.cpu_computes_bf16() is native
        resolved = config.resolve(default_config(), gpus=False)
        assert resolved["train"]["precision"] == "auto"
        hashes[cpuinfo.name] = config.train_hash(resolved, "0123456789abcdef")
    assert set(hashes.values()) == {DEFAULT_HASH}, hashes


def test_the_fast_preset_leaves_cpu_precision_to_the_ranks_and_keeps_a_users() -> None:
    train = config.validate(default_config())["train"]
    assert presets.resolve(train, 2, gpus=False)["precision"] == "auto"
    assert presets.resolve(train, 2, gpus=True)["precision"] == "bf16"  # the gpu recipe
    for asked in ("bf16", "fp32"):
        assert presets.resolve({**train, "precision": asked}, 2, gpus=False)["precision"] == asked


@pytest.mark.usefixtures("one_rank")
def test_the_ranks_decide_the_precision_from_the_cpuinfo_they_read(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cpu, host = torch.device("cpu"), socket.gethostname()
    with caplog.at_level(logging.INFO, logger="ddppipe.parallel.precision"):
        assert precision.for_world("auto", cpu, GENOA) == precision.Decision("auto", "bf16")
        on_milan = precision.for_world("auto", cpu, MILAN)
    assert on_milan == precision.Decision("auto", "fp32", (host,))
    assert caplog.messages == [
        "train.precision auto: bf16, as every rank computes bfloat16 natively",
        f"train.precision auto: fp32, as bfloat16 is only emulated on {host} (no AVX512-BF16, "
        "AMX-BF16 or Arm BF16 on a CPU, compute capability below 8.0 on a GPU), several times "
        "slower than fp32; set train.precision: bf16 to train in it anyway",
    ]
    asked = precision.for_world("bf16", cpu, MILAN)  # the user's bf16 trains, named slow
    assert (asked.trained, asked.bf16_native) == ("bf16", False)
    assert caplog.records[-1].levelno == logging.WARNING
    assert caplog.messages[-1].startswith(f"train.precision bf16, but bfloat16 is only emulated "
                                          f"on {host} (")  # fmt: skip
    assert precision.for_world("fp32", cpu, GENOA).trained == "fp32"
    assert precision.on_this_node("auto", cpu, MILAN) == "fp32"
    spec = run_spec.resolve(default_config(), gpus=False)
    trained = precision.applied(spec, on_milan)
    assert trained.train.precision == "fp32"  # what the ranks train in ...
    assert trained.train_hash("0123456789abcdef") == DEFAULT_HASH  # ... the run's identity kept


def test_one_rank_that_emulates_bf16_makes_the_whole_world_train_fp32() -> None:
    decided = precision.decide("auto", ["node3", "node1", "node3"])
    assert decided.as_dict() == {"configured": "auto", "trained": "fp32", "bf16_native": False,
                                 "emulating": ["node1", "node3"]}  # fmt: skip
    assert precision.decide("auto", []).as_dict()["trained"] == "bf16"


def recipe(train: dict[str, Any]) -> tuple:
    return tuple(train[k] for k in ("preset", "epochs", "batch_size", "optimizer", "lr"))


def test_fast_becomes_the_gpu_recipe_on_gpus() -> None:
    cfg = default_config()
    cfg["launch"]["device"] = "gpu"
    train = config.resolve(cfg, gpus=True)["train"]
    assert recipe(train) == ("gpu", 2, 256, "adamw", 0.01)
    assert (train["precision"], train["channels_last"], train["label_smoothing"]) == (
        "bf16",
        True,
        0.1,
    )


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_a_cpu_run_keeps_the_cpu_recipe(device: str) -> None:
    cfg = default_config()
    cfg["launch"]["device"] = device
    assert recipe(config.resolve(cfg, gpus=False)["train"]) == ("fast", 1, 128, "adamw", 0.006)


def test_explicit_keys_and_other_presets_win_on_gpus() -> None:
    cfg = default_config()
    cfg["train"].update(epochs=2, lr=0.003)
    assert recipe(config.resolve(cfg, gpus=True)["train"]) == ("gpu", 2, 256, "adamw", 0.003)
    cfg["train"]["preset"] = "reference"
    assert config.resolve(cfg, gpus=True)["train"]["preset"] == "reference"


def test_the_resolved_config_records_the_gpu_recipe(tmp_path: Path) -> None:
    """What the workflow writes for a run on this machine's GPU (device auto): the recipe and
    MNIST model variant it trains, and a checkpoint identity apart from the CPU recipe's."""
    cpu = resolve.write_resolved(default_config(), tmp_path / "cpu.yaml", gpus=False)
    gpu = resolve.write_resolved(default_config(), tmp_path / "gpu.yaml", gpus=True)
    written = config.load_resolved(tmp_path / "gpu.yaml")
    assert (written["train"]["preset"], written["train"]["epochs"]) == ("gpu", 2)
    assert written["task_args"]["batchnorm"] is True
    cpu_written = config.load_resolved(tmp_path / "cpu.yaml")
    assert cpu_written["train"]["preset"] == "fast" and cpu_written["task_args"]["batchnorm"]
    assert config.train_hash(gpu, "data") != config.train_hash(cpu, "data")


def test_the_users_model_choice_wins_over_the_recipes() -> None:
    cfg = default_config()
    cfg["task_args"]["batchnorm"] = False
    assert config.resolve(cfg, gpus=True)["task_args"]["batchnorm"] is False
    assert config.resolve(cfg, gpus=False)["task_args"]["batchnorm"] is False  # the seeds' CNN
    cfg["train"]["preset"] = "reference"  # the seeds' recipe keeps the seeds' CNN
    del cfg["task_args"]["batchnorm"]
    assert "batchnorm" not in config.resolve(cfg, gpus=False)["task_args"]


def test_where_auto_trains_is_answered_on_the_submitting_side() -> None:
    cfg = config.validate(default_config())
    assert not devices.trains_on_gpus(cfg, slurm=True, env={})  # SLURM executor: CPUs
    assert not devices.trains_on_gpus(cfg, slurm=False, env={"SLURM_JOB_ID": "7"})  # in a job
    cfg["launch"]["device"] = "gpu"
    assert devices.trains_on_gpus(cfg, slurm=True, env={})
    cfg["launch"]["device"] = "cpu"
    assert not devices.trains_on_gpus(cfg, slurm=False, env={})


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU")
def test_auto_on_a_machine_without_gpus_keeps_the_cpu_recipe(tmp_path: Path) -> None:
    cfg = config.validate(default_config())
    assert not devices.trains_on_gpus(cfg, slurm=False, env={})
    cfg["container"]["mode"] = "apptainer"  # no GPU for `apptainer exec --nv` either
    assert not devices.trains_on_gpus(cfg, slurm=False, env={})
    out = tmp_path / "resolved.yaml"
    run_cli("resolve-config", f"--config={REPO / 'config/config.yaml'}", f"--out={out}")
    assert config.load_resolved(out)["train"]["preset"] == "fast"


@pytest.mark.parametrize(
    ("preset", "configured", "trained"),
    [("fast", "auto", fast_cpu_precision()), ("reference", "fp32", "fp32")],
)
def test_preset_trains_one_epoch_with_two_processes(
    preset: str, configured: str, trained: str, tiny: TinyData, tmp_path: Path
) -> None:
    """Each preset's own recipe (batch, optimizer, schedule, precision), one epoch on tiny data;
    the precision its ranks trained in (this machine's CPU decides auto) in the attempt."""
    cfg = tiny_config(tiny, preset=preset, epochs=1, batch_size=None)
    launch(cfg, tiny, tmp_path)
    (line,) = (tmp_path / "metrics.jsonl").read_text().splitlines()
    metrics = json.loads(line)
    assert metrics["epoch"] == 1 and metrics["world_size"] == 2
    assert metrics["images_per_s"] > 0 and 0 <= metrics["test_accuracy"] <= 1
    assert math.isfinite(metrics["train_loss"]) and math.isfinite(metrics["test_loss"])
    resolved = config.load(tmp_path / "config.yaml")["train"]
    assert resolved["precision"] == configured
    (attempt,) = attempts.read(tmp_path / "state" / "attempts.json")
    assert attempt.precision is not None
    assert (attempt.precision["configured"], attempt.precision["trained"]) == (configured, trained)
