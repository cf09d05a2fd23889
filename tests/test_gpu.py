"""The CUDA/NCCL path on a real GPU: skipped cleanly, named, where there is none (CI).

Run with the rest of the GPU suite by `make test-gpu` (tests/gpu_suite.py: the plan, a budget,
a JSON report); each test's ``seconds`` is its expected time on one H100-class GPU.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ddppipe.launching import resolve
from ddppipe.parallel import cpu_binding
from ddppipe.parallel import software as gpu_stack
from ddppipe.runstate import attempts
from ddppipe.settings import config
from ddppipe.training.measuring import efficiency
from tests.conftest import run_cli
from tests.tiny import REAL_MNIST, TinyData, default_config, real_mnist_sha256, tiny_config


def gpu_run(tiny: TinyData, run_dir: Path, procs: int, **launch: object) -> dict:
    """A local `ddppipe launch` on ``procs`` GPUs (NCCL); its provenance."""
    cfg = tiny_config(tiny, epochs=1)
    cfg["launch"].update(nproc_per_node=procs, device="gpu", **launch)
    cfg["train"]["batch_size"] = 32 * procs
    run_dir.mkdir(parents=True)
    path = run_dir / "config.yaml"
    config.write(config.resolve(cfg, gpus=True), path)
    result = run_cli(
        "launch", f"--config={path}", f"--data={tiny.data_dir}", f"--state={run_dir / 'state'}",
        f"--checkpoint={run_dir / 'final.pt'}", f"--metrics={run_dir / 'metrics.jsonl'}",
        check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    run_cli(
        "export", f"--result={run_dir / 'model.pt'}", f"--record={run_dir / 'final.json'}",
        f"--config={path}", f"--data={tiny.data_dir}", f"--out={run_dir / 'export.pt'}",
        f"--provenance={run_dir / 'provenance.json'}",
    )  # fmt: skip
    return json.loads((run_dir / "provenance.json").read_text())


@pytest.mark.gpu(seconds=15)
def test_selfcheck_runs_nccl_on_the_gpu() -> None:
    report = json.loads(run_cli("selfcheck").stdout)
    assert report["cuda_available"] and report["backend"] == "nccl" and report["ddp_step"]
    assert report["gpus"] and report["driver"] and report["nccl"] and report["cudnn"]


@pytest.mark.parametrize("procs", [
    pytest.param(1, marks=pytest.mark.gpu(seconds=25)),
    pytest.param(2, marks=pytest.mark.gpu(seconds=25, gpus=2)),
])  # fmt: skip
def test_nccl_training_records_the_gpu_stack(tiny: TinyData, tmp_path: Path, procs: int) -> None:
    """DDP with NCCL on 1 GPU and on 2: the stack that trained in the provenance, the gpu
    recipe resolved, the final checkpoint's tensors on the CPU."""
    record = gpu_run(tiny, tmp_path / "run", procs)
    assert record["training"]["backend"] == "nccl" and record["training"]["device"] == "cuda"
    software = record["software"]
    assert software["nccl"] == gpu_stack.nccl_version() and software["cuda"] == torch.version.cuda
    assert software["gpus"][0] == torch.cuda.get_device_name(0) and software["driver"]
    assert config.load(tmp_path / "run" / "config.yaml")["train"]["preset"] == "gpu"
    final = torch.load(tmp_path / "run" / "final.pt", weights_only=True)  # no map_location
    on = {t.device.type for t in final["model"].values()}
    assert on == {"cpu"}  # a CPU machine loads it as it is


@pytest.mark.gpu(seconds=5)
def test_cuda_event_clock_times_the_gpu_work_not_its_launch() -> None:
    """The trainer's clock on a GPU: the device's time between two marks, which a host clock
    read without a synchronisation would miss."""
    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    clock = efficiency.Clock(torch.device("cuda", 0))
    started = time.perf_counter()
    start = clock.mark()
    for _ in range(50):
        a = (a @ a).tanh_()
    end = clock.mark()
    launched = time.perf_counter() - started
    seconds = clock.seconds(start, end)
    assert launched < seconds <= time.perf_counter() - started


def real_mnist_config() -> dict:
    cfg = default_config()
    cfg["task_args"] = {"mirrors": [REAL_MNIST.as_uri() + "/"], "sha256": real_mnist_sha256()}
    cfg["launch"].update(nproc_per_node=1, device="gpu")
    return cfg


@pytest.fixture(scope="module")
def real_mnist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """MNIST prepared once from the offline mirror (checksum-verified), for every seed."""
    folder = tmp_path_factory.mktemp("real-mnist")
    settings, data = folder / "data.yaml", folder / "mnist"
    config.write(config.data_settings(config.validate(real_mnist_config())), settings)
    run_cli("prepare", f"--settings={settings}", f"--dest={data}")
    return data


@pytest.mark.gpu(seconds=25)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gpu_recipe_reaches_99_percent_on_real_mnist(
    seed: int, tmp_path: Path, real_mnist: Path, record_property: Any
) -> None:
    """The default config on one GPU trains the gpu recipe: >= 99.0 % test accuracy, its
    training time (CUDA events) and warm-up recorded apart; its figures in the suite's report
    (bench/gpu.py's: images/s, training and warm-up seconds, host memory)."""
    cfg = real_mnist_config()
    cfg["train"]["seed"] = seed
    data = real_mnist
    path = tmp_path / "config.yaml"
    assert resolve.write_resolved(cfg, path)["train"]["preset"] == "gpu"
    run_cli(
        "launch", f"--config={path}", f"--data={data}", f"--state={tmp_path / 'state'}",
        f"--checkpoint={tmp_path / 'final.pt'}", f"--metrics={tmp_path / 'metrics.jsonl'}",
        f"--attempts={tmp_path / 'attempts.json'}",
    )  # fmt: skip
    evaluation = json.loads((tmp_path / "evaluation.json").read_text())
    figures = attempts.read(tmp_path / "attempts.json")[-1].efficiency
    print(f"seed {seed}: {evaluation['test_accuracy']:.4f}, {figures}")
    epochs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    record_property("test_accuracy", evaluation["test_accuracy"])
    record_property("train_s", round(sum(e["train_seconds"] for e in epochs), 3))
    for key in ("images_per_s", "warmup_s", "memory_peak_mb"):
        record_property(key, figures.get(key))
    assert evaluation["test_accuracy"] >= 0.99
    assert figures["warmup_s"] > 0 and figures["images_per_s"] > 0


@pytest.mark.gpu(seconds=15)
def test_two_ranks_on_one_gpu_are_refused(tiny: TinyData, tmp_path: Path) -> None:
    """One visible GPU, two processes: a clear error instead of NCCL's duplicate-GPU abort."""
    cfg = tiny_config(tiny)
    cfg["launch"].update(nproc_per_node=2, device="gpu")
    path = tmp_path / "config.yaml"
    config.write(config.resolve(cfg, gpus=True), path)
    result = run_cli(
        "launch", f"--config={path}", f"--data={tiny.data_dir}", f"--state={tmp_path / 'st'}",
        f"--checkpoint={tmp_path / 'final.pt'}", f"--metrics={tmp_path / 'm.jsonl'}",
        env={"CUDA_VISIBLE_DEVICES": "0"}, check=False,
    )  # fmt: skip
    assert result.returncode != 0
    assert "share one GPU" in result.stderr, result.stderr[-3000:]
    assert not (tmp_path / "final.pt").exists()


@pytest.mark.gpu(seconds=15)
def test_preflight_allreduce_with_nccl_reports_bandwidth(record_property: Any) -> None:
    procs = torch.cuda.device_count()
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={procs}", "-m", "ddppipe", "preflight-allreduce",
         "--use=gpu", "--precision=bf16"],
        capture_output=True, text=True, timeout=300, env=dict(os.environ), check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "all-reduce ok (nccl on cuda:0); bus bandwidth world" in result.stdout, result.stdout
    peak = re.search(r"GEMM peak \(bf16\): \S+ ([\d,]+) GFLOP/s", result.stdout)
    assert peak, result.stdout
    print(result.stdout)
    record_property("gemm_peak_bf16_gflops", int(peak.group(1).replace(",", "")))
    record_property("preflight", result.stdout.strip().splitlines())


@pytest.mark.gpu(seconds=10)
def test_node_check_accepts_this_gpu_for_training() -> None:
    precision = "bf16" if torch.cuda.get_device_capability(0) >= (8, 0) else "fp32"
    result = run_cli(
        "preflight-node", "--nproc=1", "--use=gpu", f"--precision={precision}", check=False
    )
    assert result.returncode == 0, result.stderr
    assert torch.cuda.get_device_name(0) in result.stdout


@pytest.mark.gpu(seconds=5)
def test_a_gpu_rank_finds_its_gpus_numa_node_and_binds_near_it() -> None:
    """GPU 0's PCI address as torch gives it names its sysfs device (else no binding at all);
    one rank on it is bound to CPUs of its NUMA node, every one of them on a one-node machine."""
    code = (
        "import json, os; from ddppipe.parallel import cpu_binding; "
        "print(json.dumps(cpu_binding.bind_gpu_rank(0, 0, [0])))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300, check=False)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    bound = json.loads(result.stdout.splitlines()[-1])
    p = torch.cuda.get_device_properties(0)
    pci = f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
    node = max(0, int(Path(f"/sys/bus/pci/devices/{pci}/numa_node").read_text()))
    nodes = list(Path("/sys/devices/system/node").glob("node[0-9]*"))
    if len(nodes) == 1:
        assert bound == sorted(os.sched_getaffinity(0)), (bound, result.stderr[-2000:])
    elif bound is not None:  # several nodes: unbound is right where the job's CPUs lie elsewhere
        text = Path(f"/sys/devices/system/node/node{node}/cpulist").read_text()
        node_cpus = set(cpu_binding.cpu_list(text))  # the parser test_cpu_binding.py checks
        assert set(bound) <= node_cpus & os.sched_getaffinity(0), (bound, node)
