"""The CUDA/NCCL path on a real GPU: skipped cleanly where there is none (CI).

Run on a GPU machine with ``python -m pytest tests/test_gpu.py``.
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

from ddppipe import config, provenance
from tests.conftest import requires_gpu, run_cli
from tests.tiny import TinyData, tiny_config

pytestmark = [pytest.mark.gpu, requires_gpu]


def gpu_run(tiny: TinyData, run_dir: Path, procs: int, **launch: object) -> dict:
    """A local `ddppipe launch` on ``procs`` GPUs (NCCL); its provenance."""
    cfg = tiny_config(tiny, epochs=1)
    cfg["launch"].update(nproc_per_node=procs, device="gpu", **launch)
    cfg["train"]["batch_size"] = 32 * procs
    run_dir.mkdir(parents=True)
    path = run_dir / "config.yaml"
    config.write(config.resolve(cfg), path)
    result = run_cli(
        "launch", f"--config={path}", f"--data={tiny.data_dir}", f"--state={run_dir / 'state'}",
        f"--checkpoint={run_dir / 'final.pt'}", f"--metrics={run_dir / 'metrics.jsonl'}",
        check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    run_cli(
        "export", f"--result={run_dir / 'final.pt'}", f"--config={path}",
        f"--data={tiny.data_dir}", f"--out={run_dir / 'model.pt'}",
        f"--provenance={run_dir / 'provenance.json'}",
    )  # fmt: skip
    return json.loads((run_dir / "provenance.json").read_text())


def test_selfcheck_runs_nccl_on_the_gpu() -> None:
    report = json.loads(run_cli("selfcheck").stdout)
    assert report["cuda_available"] and report["backend"] == "nccl" and report["ddp_step"]
    assert report["gpus"] and report["driver"] and report["nccl"] and report["cudnn"]


def test_nccl_training_records_the_gpu_stack(tiny: TinyData, tmp_path: Path) -> None:
    procs = min(torch.cuda.device_count(), 2)
    record = gpu_run(tiny, tmp_path / "run", procs)
    assert record["training"]["backend"] == "nccl" and record["training"]["device"] == "cuda"
    software = record["software"]
    assert software["nccl"] == provenance.nccl_version() and software["cuda"] == torch.version.cuda
    assert software["gpus"][0] == torch.cuda.get_device_name(0) and software["driver"]


def test_two_ranks_on_one_gpu_are_refused(tiny: TinyData, tmp_path: Path) -> None:
    """One visible GPU, two processes: a clear error instead of NCCL's duplicate-GPU abort."""
    cfg = tiny_config(tiny)
    cfg["launch"].update(nproc_per_node=2, device="gpu")
    path = tmp_path / "config.yaml"
    config.write(config.resolve(cfg), path)
    result = run_cli(
        "launch", f"--config={path}", f"--data={tiny.data_dir}", f"--state={tmp_path / 'st'}",
        f"--checkpoint={tmp_path / 'final.pt'}", f"--metrics={tmp_path / 'm.jsonl'}",
        env={"CUDA_VISIBLE_DEVICES": "0"}, check=False,
    )  # fmt: skip
    assert result.returncode != 0
    assert "share one GPU" in result.stderr, result.stderr[-3000:]
    assert not (tmp_path / "final.pt").exists()


def test_preflight_allreduce_with_nccl_reports_bandwidth() -> None:
    procs = torch.cuda.device_count()
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={procs}", "-m", "ddppipe", "preflight-allreduce",
         "--use=gpu", "--precision=bf16"],
        capture_output=True, text=True, timeout=300, env=dict(os.environ), check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "all-reduce ok (nccl on cuda:0); bus bandwidth world" in result.stdout, result.stdout
    assert re.search(r"GEMM peak \(bf16\): \S+ [\d,]+ GFLOP/s", result.stdout), result.stdout
    print(result.stdout)


def test_node_check_accepts_this_gpu_for_training() -> None:
    precision = "bf16" if torch.cuda.get_device_capability(0) >= (8, 0) else "fp32"
    result = run_cli(
        "preflight-node", "--nproc=1", "--use=gpu", f"--precision={precision}", check=False
    )
    assert result.returncode == 0, result.stderr
    assert torch.cuda.get_device_name(0) in result.stdout
