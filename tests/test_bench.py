"""The benchmark script's quick mode runs end to end (so that it cannot rot); the GPU bench
refuses a machine without a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.tiny import REPO


def test_benchmark_quick_mode(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "bench" / "benchmark.py"), "--quick", f"--json={out}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert "(a) training throughput" in text and "(b) wall time from launch" in text
    for name in [
        "classic DataLoader script",
        "ddppipe, reference recipe, fp32",
        "ddppipe, reference recipe + bf16 + channels_last",
        "ddppipe fast",
    ]:
        assert name in text, name
    assert "(c) the goals" in text and "of the peak (goal >= 50 %)" in text
    measured = json.loads(out.read_text())
    assert measured["quick"] is True and measured["bf16_gemm_peak_gflops"] > 0
    assert len(measured["runs"]) == 4  # classic, reference fp32 and bf16, fast (1 seed)
    for run in measured["runs"]:
        assert run["images_per_s"] > 0 and run["epochs"], run["name"]
    # the classic script as the seeds run it (one process); ddppipe's runs on 2 processes
    assert [run["epochs"][0]["world_size"] for run in measured["runs"]] == [1, 2, 2, 2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU")
def test_gpu_bench_refuses_without_a_gpu() -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu.py"), "--mirror=file:///nowhere/"],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.strip() == "bench/gpu.py: no CUDA GPU here: nothing to measure"
