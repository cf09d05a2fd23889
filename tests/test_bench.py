"""The benchmark script's quick mode runs end to end (so that it cannot rot); the GPU bench
refuses a machine without a GPU."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.tiny import REPO, make_tiny


@pytest.mark.slow  # about a minute on 2 cores
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
    assert "the fast preset's convolutions and matrix products alone (2 processes" in text
    measured = json.loads(out.read_text())
    assert measured["quick"] is True and measured["bf16_gemm_peak_gflops"] > 0
    assert measured["kernel_bound_gflops"] > 0
    assert len(measured["runs"]) == 4  # classic, reference fp32 and bf16, fast (1 seed)
    for run in measured["runs"]:
        assert run["images_per_s"] > 0 and run["epochs"], run["name"]
    # the classic script as the seeds run it (one process); ddppipe's runs on 2 processes
    assert [run["epochs"][0]["world_size"] for run in measured["runs"]] == [1, 2, 2, 2]


@pytest.mark.slow  # 13 s on 2 cores
def test_kernel_bound_replays_exactly_the_steps_flop_carrying_kernels(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fast preset's step of the BatchNorm CNN, 4 images: its recorded kernels are the two
    convolutions and two linear layers, forward and backward (the first convolution computes no
    input gradient), and carry the step's 71,565,312 FLOPs an image (the training's count).
    The script measures them on 2 processes at once."""
    monkeypatch.syspath_prepend(REPO / "bench")  # also for the processes the script spawns
    import kernel_bound

    data = make_tiny(tmp_path)
    cfg = kernel_bound.bench_config(2, 1, data.sha256, preset="fast")
    calls = kernel_bound.record(kernel_bound.training_step(cfg, data.data_dir, 4))
    names = sorted(str(func) for func, _, _ in calls)
    assert names == sorted(
        ["aten.convolution.default"] * 2 + ["aten.convolution_backward.default"] * 2
        + ["aten.addmm.default"] * 2 + ["aten.mm.default"] * 4
    )  # fmt: skip
    assert kernel_bound.flops(calls) == 4 * 71_565_312
    conv1_backward = next(
        args for func, args, _ in calls
        if str(func) == "aten.convolution_backward.default" and args[2].shape[1] == 1
    )  # fmt: skip
    assert conv1_backward[-1] == [False, True, True]  # no gradient of the input images

    assert kernel_bound.main([f"--data={data.data_dir}", "--nproc=2"]) == 0
    printed = capsys.readouterr().out
    assert re.fullmatch(
        r"the default config's step kernels alone, 2 processes x 1 thread\(s\): [\d,]+ GFLOP/s\n",
        printed,
    ), printed


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU")
@pytest.mark.parametrize(("mode", "what"), [([], "measure"), (["--profile"], "profile")])
def test_gpu_bench_refuses_without_a_gpu(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], mode: list[str],
    what: str,
) -> None:  # fmt: skip
    """Its main() in this process, as `python bench/gpu.py --mirror=... [--profile]` calls
    it: no figure without a GPU."""
    spec = importlib.util.spec_from_file_location("bench_gpu", REPO / "bench" / "gpu.py")
    assert spec and spec.loader
    gpu_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_bench)
    monkeypatch.setattr(sys, "argv", ["bench/gpu.py", "--mirror=file:///nowhere/", *mode])
    assert gpu_bench.main() == 1
    captured = capsys.readouterr()
    assert captured.err.strip() == f"bench/gpu.py: no CUDA GPU here: nothing to {what}"
    assert captured.out == ""


def test_the_gpu_profile_counts_the_gpus_busy_time_once() -> None:
    """The union of kernels' intervals: overlapping ones counted once."""
    spec = importlib.util.spec_from_file_location("bench_gpu", REPO / "bench" / "gpu.py")
    assert spec and spec.loader
    gpu_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_bench)
    assert gpu_bench.busy_us([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17
