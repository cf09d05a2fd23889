"""The compute peak a training is measured against: a GEMM benchmark, or a table for known GPUs.

The world's checks (:mod:`ddppipe.training.measuring.world_checks`) run :func:`gemm_gflops` on
every rank of a SLURM slot at once, before its first step (so a node's figure is what its
processes reach together, in the training's dtype); each slot's attempt record carries the
per-node sums, and :func:`ddppipe.reports.utilisation.utilisation` divides the achieved FLOP/s
by them. Where they did not run (a local run), GPUs fall back to their datasheet's dense peak
(:data:`GPU_PEAK_TFLOPS`); a CPU then has no peak figure, and the summary says so instead of
guessing.
"""

from __future__ import annotations

import time
from typing import Any

from ddppipe.parallel import devices

# n of the n x n x n matmul, tried in turn: the largest whose one product takes at most a
# quarter of GEMM_SECONDS (2048: 17.2 GFLOP, large enough to reach the peak; a CPU without
# native bf16 takes about a minute for one such product in bf16, and 0.1 s for a 256 one)
GEMM_SIZES = (256, 512, 1024, 2048)
GEMM_SECONDS = 0.5  # measuring time per process, after one warm-up product

# Dense (no sparsity) tensor-core peaks from the vendors' datasheets, TFLOP/s per GPU; the
# first name contained in torch's device name wins, so specific names come first.
GPU_PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H200", {"bf16": 989.0, "fp32": 67.0}),
    ("H100 PCIe", {"bf16": 756.0, "fp32": 51.0}),
    ("H100", {"bf16": 989.0, "fp32": 67.0}),  # SXM
    ("GH200", {"bf16": 989.0, "fp32": 67.0}),
    ("A100", {"bf16": 312.0, "fp32": 19.5}),
    ("A40", {"bf16": 149.7, "fp32": 37.4}),
    ("L40S", {"bf16": 362.0, "fp32": 91.6}),
    ("L4", {"bf16": 121.0, "fp32": 30.3}),
    ("V100", {"bf16": 0.0, "fp32": 15.7}),  # no bf16 tensor cores: ddppipe refuses bf16 there
)


def gemm_gflops(device: Any, precision: str, seconds: float = GEMM_SECONDS) -> float:
    """GFLOP/s of repeated square matmuls in ``precision`` on ``device``, of the largest of
    :data:`GEMM_SIZES` that fits the measuring time."""
    import torch

    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    if torch.device(device).type == "cuda":
        devices.speed_up_cuda()  # fp32 as training computes it: TF32 (its peak, not FP32's)
    for n in GEMM_SIZES:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        started = time.perf_counter()
        torch.mm(a, b)  # warm-up: kernel choice, caches, frequency; and this size's time
        devices.synchronize(a.device)
        if 8 * (time.perf_counter() - started) > seconds / 4:  # the next size would not fit
            break
    products, started = 0, time.perf_counter()
    while True:
        for _ in range(4 if a.is_cuda else 1):
            torch.mm(a, b)
            products += 1
        devices.synchronize(a.device)
        elapsed = time.perf_counter() - started
        if elapsed >= seconds:
            return 2 * n**3 * products / elapsed / 1e9


def gpu_datasheet_gflops(name: str, precision: str) -> float | None:
    """The datasheet's dense peak of the GPU called ``name`` in GFLOP/s; None if unknown."""
    for model, peaks in GPU_PEAK_TFLOPS:
        if model in name and peaks.get(precision):
            return peaks[precision] * 1e3
    return None
