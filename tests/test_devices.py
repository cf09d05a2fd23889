"""The device a rank trains on, for every visibility case, and why a GPU run cannot start.

The device count is stubbed (the one place a stub is right: there is no GPU here); the
environments are the ones the launchers really set.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ddppipe.apptainer import running
from ddppipe.parallel import devices, distributed, environments
from ddppipe.settings import run_spec as run_spec
from tests.tiny import default_config


def gpu_config(gpus: int = 0) -> dict[str, Any]:
    cfg = default_config()
    cfg["launch"].update(device="gpu" if gpus else "auto", nproc_per_node=max(gpus, 1))
    return cfg


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch):
    """``gpus(n)``: this process sees ``n`` CUDA devices (a CUDA build of torch)."""

    def see(count: int) -> None:
        monkeypatch.setattr(torch.version, "cuda", torch.version.cuda or "13.0")
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)

    return see


def test_the_device_is_decided_once_and_recorded_in_the_spec(
    gpus, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert devices.trains_on_gpus(gpu_config(gpus=4), slurm=True, env={})  # device: gpu
    # A SLURM job that asked for no GPU must not take the node's (another job's) GPUs.
    assert not devices.trains_on_gpus(gpu_config(), slurm=False, env={"SLURM_JOB_ID": "7"})
    assert not devices.trains_on_gpus(gpu_config(), slurm=True, env={})
    gpus(2)  # a laptop with an NVIDIA driver whose torch sees 2 GPUs trains on them
    monkeypatch.setattr(running, "gpus_present", lambda: True)
    assert devices.trains_on_gpus(gpu_config(), slurm=False, env={})
    assert run_spec.resolve(gpu_config(), gpus=True).device == "gpu"


# Launcher environment, devices the rank sees -> the CUDA index it must train on.
VISIBILITY = [
    pytest.param(  # torchrun on a node with all 4 GPUs visible to every rank
        {"TORCHELASTIC_RUN_ID": "1", "RANK": "7", "LOCAL_RANK": "3", "WORLD_SIZE": "8",
         "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, 4, 3, id="torchrun-all",
    ),
    pytest.param(  # srun --gpus-per-task=1 (or --gpu-bind=single:1): each task sees its own
        {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_STEP_NUM_TASKS": "8",
         "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_STEP_NODELIST": "gpu[01-02]",
         "SLURMD_NODENAME": "gpu02", "CUDA_VISIBLE_DEVICES": "1"}, 1, 0, id="srun-gpus-per-task",
    ),
    pytest.param(  # srun with the node's GPUs visible to each task: its local id
        {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_STEP_NUM_TASKS": "8",
         "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_STEP_NODELIST": "gpu[01-02]",
         "SLURMD_NODENAME": "gpu02", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}, 4, 1, id="srun-all",
    ),
    pytest.param(  # uneven tasks per node: this node runs 3
        {"SLURM_PROCID": "6", "SLURM_LOCALID": "2", "SLURM_STEP_NUM_TASKS": "7",
         "SLURM_STEP_TASKS_PER_NODE": "4,3", "SLURM_STEP_NODELIST": "gpu[01-02]",
         "SLURMD_NODENAME": "gpu02"}, 3, 2, id="srun-uneven",
    ),
    pytest.param(  # --gpu-bind giving each of 4 ranks 2 of 8 GPUs: the first of its own
        {"TORCHELASTIC_RUN_ID": "1", "RANK": "3", "LOCAL_RANK": "3", "WORLD_SIZE": "4",
         "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, 2, 0, id="bind-pairs",
    ),
    pytest.param(  # a MIG slice (or a device cgroup): one device, whatever the local rank
        {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
         "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
         "CUDA_VISIBLE_DEVICES": "MIG-5c0a9b6e-3f1d-5a8e-9c1b-2d4e6f8a0b1c"}, 1, 0, id="mig",
    ),
    pytest.param({}, 1, 0, id="single-process"),
]  # fmt: skip


@pytest.mark.parametrize(("env", "visible", "index"), VISIBILITY)
def test_device_for_each_visibility(env: dict[str, str], visible: int, index: int, gpus) -> None:
    gpus(visible)
    launcher = environments.detect(env)
    device = devices.select(launcher.local_rank, launcher.local_world_size, "gpu")
    assert device == torch.device("cuda", index)


def test_cpu_when_the_run_asked_for_none(gpus) -> None:
    gpus(4)
    assert devices.select(0, 1, "cpu") == torch.device("cpu")


def test_required_gpu_missing_fails_naming_what_the_rank_sees(gpus, monkeypatch) -> None:
    gpus(0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(devices.DeviceError) as e:
        devices.select(1, 2, "gpu")
    message = str(e.value)
    for part in ("local rank 1 needs a GPU", "CUDA_VISIBLE_DEVICES='0,1'", "0 CUDA device(s)",
                 f"torch {torch.__version__}", "NVIDIA driver", "Fix:"):  # fmt: skip
        assert part in message, message


def test_setup_refuses_cpu_fallback(gpus, monkeypatch) -> None:
    """The trainer's own entry: GPUs asked for, none usable -> DeviceError, no process group."""
    gpus(0)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    with pytest.raises(devices.DeviceError, match="needs a GPU"):
        distributed.setup(use="gpu")
    assert not torch.distributed.is_initialized()


def seen(**kw: Any) -> devices.Seen:
    facts = dict(host="gpu07", visible_devices="0", count=0, torch="2.14.1", cuda_build="13.0",
                 driver="580.65.06", libcuda=True, init_error=None, container=None)  # fmt: skip
    return devices.Seen(**{**facts, **kw})


@pytest.mark.parametrize(
    ("facts", "advice"),
    [
        ({"cuda_build": None}, "CPU-only build"),
        ({"visible_devices": ""}, "hides every GPU"),
        ({"visible_devices": "NoDevFiles"}, "hides every GPU"),
        ({"driver": None}, "no NVIDIA driver is loaded"),
        ({"container": "/img/ddppipe.sif", "libcuda": False}, "apptainer exec --nv"),
        ({"init_error": "The NVIDIA driver on your system is too old (found version 11040)"},
         "older than CUDA 13.0"),
        ({"init_error": "CUDA unknown error"}, "CUDA unknown error"),
    ],
)  # fmt: skip
def test_advice_names_the_likely_cause(facts: dict[str, Any], advice: str) -> None:
    error = devices.no_gpu_error(seen(**facts), "2 process(es) need a GPU each")
    assert str(error).startswith("gpu07: 2 process(es) need a GPU each; it sees ")
    assert advice in str(error)


ARCHS = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]


@pytest.mark.parametrize(
    ("capability", "archs", "ok"),
    [
        ((9, 0), ARCHS, True),  # H100
        ((8, 9), ARCHS, True),  # L40: runs the sm_86 binaries
        ((7, 0), ARCHS, False),  # V100: dropped by CUDA 13 builds
        ((6, 0), ARCHS, False),  # P100
        ((10, 3), [*ARCHS[:-1], "compute_90"], True),  # PTX JIT-compiles for newer GPUs
        ((9, 0), ["sm_80", "sm_90a"], True),  # architecture-specific: H100 only (it raised)
        ((10, 0), ["sm_90a", "sm_100a"], True),
        ((10, 3), ["sm_90a", "sm_100a"], False),  # sm_100a runs on 10.0 alone
        ((10, 3), ["sm_90", "sm_100f"], True),  # family-specific: later minors of 10
        ((12, 0), ["sm_90", "sm_100f", "unknown"], False),
    ],
)
def test_compute_capability_against_the_torch_build(
    capability: tuple[int, int], archs: list[str], ok: bool
) -> None:
    assert devices._arch_supported(capability, archs) is ok


def test_bf16_only_where_computed_natively() -> None:
    devices.check_precision("NVIDIA A100", (8, 0), "bf16")
    devices.check_precision("Tesla V100", (7, 0), "fp32")
    for name, cc in (("Tesla V100", (7, 0)), ("Tesla T4", (7, 5))):
        with pytest.raises(devices.DeviceError, match=r"only emulates bfloat16.*precision: fp32"):
            devices.check_precision(name, cc, "bf16")


def test_node_check_on_cpu_and_missing_gpus(gpus) -> None:
    assert "2 process(es) on CPUs" in devices.node_check(2, "cpu", "bf16")
    gpus(1)
    with pytest.raises(devices.DeviceError, match="4 processes need a GPU each but 1 are visible"):
        devices.node_check(4, "gpu", "fp32")


def test_each_rank_knows_the_gpus_its_node_trains_on() -> None:
    # 4 ranks that see the node's 4 GPUs: one each, all 4 in use
    assert [devices.device_index(r, 4, 4) for r in range(4)] == [0, 1, 2, 3]
    assert devices.node_devices(2, 4, 4) == [0, 1, 2, 3]
    # a rank that sees only its own GPU (srun --gpus-per-task=1): its index 0, no other
    assert devices.device_index(3, 1, 4) == 0
    assert devices.node_devices(0, 1, 4) == [0]
