"""ddppipe against the classic DataLoader-based DDP MNIST script, on this machine, in one run.

Prints two tables:

(a) training throughput with the same CNN, 64 images per rank and Adadelta: the classic script
    (bench/classic_ddp_mnist.py) against ddppipe's `reference` recipe in fp32 and with ddppipe's
    speed settings (bf16 autocast, channels_last);
(b) wall time from launch to the first epoch whose test accuracy reaches the target (99 %):
    the classic script as the seeds run it (one process using every CPU, batch 64) against
    ddppipe's `fast` preset (default config: --nproc processes) with 3 seeds;
(c) the `fast` runs' steady training FLOP/s as a fraction of this machine's bf16 GEMM peak,
    measured in the same run as the preflight measures it (every training process multiplying
    2048x2048 matrices at once), and the issue's goals (>= 50 % of the peak; 99 % in <= 0.10x
    the classic script's time, every seed); with them the most the fast preset's model can
    reach here: its step's convolutions and matrix products alone (bench/kernel_bound.py).

Times include process start-up, data loading and the per-epoch evaluations.

    python bench/benchmark.py                 # real MNIST in resources/mnist (minutes)
    python bench/benchmark.py --quick         # tiny generated data, a few seconds: CI smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import kernel_bound
import torch

from ddppipe.core import hashing, system
from ddppipe.data import idx, manifest, mnist_files
from ddppipe.launching import launch
from ddppipe.settings import config

REPO = Path(__file__).resolve().parents[1]
CLASSIC = Path(__file__).resolve().parent / "classic_ddp_mnist.py"
BATCH_PER_RANK = 64  # the classic script's batch


@dataclass
class Run:
    """One training run and what it measured."""

    name: str
    recipe: str
    wall_seconds: float = 0.0
    epochs: list[dict[str, Any]] = field(default_factory=list)  # each with "time", "test_accuracy"
    start: float = 0.0  # Unix time at launch
    load_before: float = 0.0
    load_after: float = 0.0
    achieved_gflops: float = 0.0  # steady training FLOP/s of the last slot (ddppipe runs)

    @property
    def images_per_s(self) -> float:
        """Training images/s over all epochs (all ranks; evaluation not counted)."""
        images = sum(e["train_images"] for e in self.epochs)
        seconds = sum(e["train_seconds"] for e in self.epochs)
        return images / seconds

    def time_to(self, target: float) -> tuple[float, int] | None:
        """(seconds from launch, epoch) of the first evaluation reaching ``target``."""
        for e in self.epochs:
            if e["test_accuracy"] >= target:
                return e["time"] - self.start, e["epoch"]
        return None

    @property
    def final_accuracy(self) -> float:
        return self.epochs[-1]["test_accuracy"]


# -- data ----------------------------------------------------------------------------------
def write_tiny(folder: Path, n_train: int = 256, n_test: int = 128) -> None:
    """Tiny MNIST-like IDX files whose image brightness encodes the label."""
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    for images_name, labels_name, n in (
        (mnist_files.TRAIN_IMAGES, mnist_files.TRAIN_LABELS, n_train),
        (mnist_files.TEST_IMAGES, mnist_files.TEST_LABELS, n_test),
    ):
        labels = torch.randint(0, 10, (n,), generator=g, dtype=torch.uint8)
        noise = torch.randint(0, 40, (n, 28, 28), generator=g)
        images = (noise + 20 * labels.long().view(-1, 1, 1)).clamp(max=255).to(torch.uint8)
        (folder / images_name).write_bytes(idx.encode(images))
        (folder / labels_name).write_bytes(idx.encode(labels))


def torchvision_root(data: Path, root: Path) -> Path:
    """A folder laid out as torchvision's MNIST expects (``MNIST/raw/<files>``), via links."""
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for name in mnist_files.FILES:
        (raw / name).symlink_to((data / name).resolve())
    return root


# -- runs ----------------------------------------------------------------------------------
def run_classic(
    data: Path, work: Path, nproc: int, threads: int, epochs: int, target: float, workers: int
) -> Run:
    """The classic script under torchrun, stopped after the first epoch reaching ``target``
    (the seeds run it as one process: ``nproc`` 1 with every CPU)."""
    root = torchvision_root(data, work / "torchvision")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes=1",
        f"--nproc-per-node={nproc}",
        str(CLASSIC),
        f"--root={root}",
        f"--epochs={epochs}",
        f"--batch-size={BATCH_PER_RANK}",
        f"--num-workers={workers}",
        f"--stop-at={target}",
    ]
    run = Run("classic DataLoader script", "classic: Adadelta lr 1.0, StepLR 0.7, 64/rank, fp32")
    out = _timed(run, command, launch.process_environment(threads), work / "classic.log")
    run.epochs = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return run


def run_ddppipe(name: str, recipe: str, cfg: dict, data: Path, work: Path) -> Run:
    """``ddppipe launch`` (torchrun) with ``cfg``, as the pipeline's train rule runs it."""
    folder = work / name.replace(" ", "_").replace("+", "")
    folder.mkdir(parents=True)
    cfg_path = folder / "config.yaml"
    config.write(cfg, cfg_path)
    metrics = folder / "metrics.jsonl"
    command = [
        sys.executable,
        "-m",
        "ddppipe",
        "launch",
        f"--config={cfg_path}",
        f"--data={data}",
        f"--state={folder / 'state'}",
        f"--checkpoint={folder / 'final.pt'}",
        f"--metrics={metrics}",
    ]
    run = Run(name, recipe)
    _timed(run, command, dict(os.environ), folder / "launch.log")
    run.epochs = [json.loads(line) for line in metrics.read_text().splitlines() if line]
    for e in run.epochs:
        e["train_images"] = e["images_per_s"] * e["train_seconds"]
    (attempt,) = json.loads((folder / "state" / "attempts.json").read_text())
    run.achieved_gflops = attempt["efficiency"].get("achieved_gflops", 0.0)
    return run


def gemm_peak(nproc: int, threads: int, precision: str, work: Path) -> float:
    """This machine's GEMM peak in GFLOP/s as the preflight measures it: ``nproc`` processes
    of ``threads`` threads multiplying matrices at the same time (``preflight-allreduce``)."""
    out = work / "peak.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
               f"--nproc-per-node={nproc}", "-m", "ddppipe", "preflight-allreduce", "--use=cpu",
               f"--precision={precision}", f"--peak-out={out}"]  # fmt: skip
    result = subprocess.run(command, env=launch.process_environment(threads), cwd=REPO,
                            capture_output=True, text=True, check=False)  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError("the GEMM peak measurement failed:\n" + result.stderr[-3000:])
    return sum(json.loads(out.read_text())["gflops"].values())


def _timed(run: Run, command: list[str], env: dict[str, str], log: Path) -> str:
    """Run ``command``, recording its wall time and the load around it; return its stdout."""
    print(f"running: {run.name} ...", file=sys.stderr, flush=True)
    run.load_before = os.getloadavg()[0]
    run.start = time.time()
    t0 = time.perf_counter()
    result = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True)
    run.wall_seconds = time.perf_counter() - t0
    run.load_after = os.getloadavg()[0]
    log.write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        raise RuntimeError(
            f"{run.name} failed ({result.returncode}); see {log}:\n" + result.stderr[-3000:]
        )
    return result.stdout


# -- report --------------------------------------------------------------------------------
def _ratio(value: float | None, base: float | None) -> str:
    return "n/a" if value is None or not base else f"{value / base:.2f}x"


def throughput_table(classic: Run, others: list[Run]) -> str:
    lines = [
        "| run (same CNN, 64 images/rank, Adadelta) | training images/s | vs classic |",
        "|---|---:|---:|",
    ]
    for run in [classic, *others]:
        lines.append(
            f"| {run.name} | {run.images_per_s:,.0f} | "
            f"{_ratio(run.images_per_s, classic.images_per_s)} |"
        )
    return "\n".join(lines)


def time_table(classic: Run, fast: list[Run], target: float) -> str:
    pct = f"{100 * target:.1f} %"
    lines = [
        f"| recipe | time to {pct} test accuracy | epochs | final test accuracy | vs classic |",
        "|---|---:|---:|---:|---:|",
    ]
    base = classic.time_to(target)
    for run in (classic, *fast):
        reached = run.time_to(target)
        seconds = f"{reached[0]:.1f} s" if reached else "not reached"
        epoch = str(reached[1]) if reached else f"({len(run.epochs)} run)"
        ratio = _ratio(reached[0] if reached else None, base[0] if base else None)
        lines.append(
            f"| {run.recipe} | {seconds} | {epoch} | {100 * run.final_accuracy:.2f} % | {ratio} |"
        )
    return "\n".join(lines)


def goals(classic: Run, fast: list[Run], target: float, peak: float, bound: float,
          nproc: int) -> str:  # fmt: skip
    """The issue's goals, from this run's figures, and the bound the model's kernels set."""
    fractions = [r.achieved_gflops / peak for r in fast]
    base = classic.time_to(target)
    ratios = [
        reached[0] / base[0] if base and (reached := r.time_to(target)) else float("inf")
        for r in fast
    ]
    accuracies = ", ".join(f"{100 * r.final_accuracy:.2f} %" for r in fast)
    of_bound = ", ".join(f"{r.achieved_gflops / bound:.0%}" for r in fast)
    return "\n".join([
        f"bf16 GEMM peak of this machine ({nproc} processes at once): {peak:,.0f} GFLOP/s",
        f"the fast preset's convolutions and matrix products alone ({nproc} processes at once, "
        f"bench/kernel_bound.py): {bound:,.0f} GFLOP/s = {bound / peak:.0%} of the peak, the "
        f"most its training can reach here; the runs reach {of_bound} of it",
        f"fast preset, steady training: {', '.join(f'{r.achieved_gflops:,.0f}' for r in fast)} "
        f"GFLOP/s = {', '.join(f'{f:.0%}' for f in fractions)} of the peak (goal >= 50 %): "
        f"{'met' if min(fractions) >= 0.5 else 'not met'}",
        f"time to {100 * target:.1f} % against the classic script: "
        f"{', '.join(f'{x:.2f}x' for x in ratios)} (goal <= 0.10x, every seed): "
        f"{'met' if max(ratios) <= 0.10 else 'not met'}",
        f"final test accuracy of the seeds: {accuracies} (goal >= {100 * target:.1f} % each): "
        f"{'met' if min(r.final_accuracy for r in fast) >= target else 'not met'}",
    ])  # fmt: skip


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {system.available_cpus()} CPUs, torch {torch.__version__}"


# -- main ----------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="tiny generated data and one epoch per run (a smoke test, not figures)",
    )
    ap.add_argument(
        "--data",
        type=Path,
        default=REPO / "resources" / "mnist",
        help="folder with the four decompressed MNIST IDX files",
    )
    ap.add_argument("--nproc", type=int, default=2, help="processes of every ddppipe run")
    ap.add_argument("--seeds", type=int, default=3, help="seeds of the fast preset (quick: 1)")
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads per process (default: the CPUs divided by --nproc)",
    )
    ap.add_argument("--target", type=float, default=0.99, help="test accuracy to time")
    ap.add_argument(
        "--classic-workers",
        type=int,
        default=1,
        help="DataLoader worker processes per rank of the classic script",
    )
    ap.add_argument(
        "--max-classic-epochs",
        type=int,
        default=14,
        help="the classic run stops here if it never reaches the target",
    )
    ap.add_argument("--json", type=Path, help="also write the measurements here")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads = args.threads or max(1, system.available_cpus() // args.nproc)
    with tempfile.TemporaryDirectory(prefix="ddppipe-bench-") as tmp:
        work = Path(tmp)
        data = args.data
        if args.quick:
            data = work / "tiny"
            write_tiny(data)
            sha = {name: hashing.file_sha256(data / name) for name in mnist_files.FILES}
            manifest.write(data, {"ref": "ddppipe.tasks.mnist"}, {"sha256": sha})
        elif not (data / manifest.NAME).is_file():
            print(
                f"{data} holds no prepared MNIST ({manifest.NAME}): run "
                "`snakemake --cores all prepare_data` or pass --data",
                file=sys.stderr,
            )
            return 2
        sha = {name: hashing.file_sha256(data / name) for name in mnist_files.FILES}
        epochs = {"epochs": 1} if args.quick else {}
        speed = {"precision": "bf16", "channels_last": True}
        batch = BATCH_PER_RANK * args.nproc

        peak = gemm_peak(args.nproc, threads, "bf16", work)
        fast_shape = kernel_bound.bench_config(args.nproc, threads, sha, preset="fast")
        bound = kernel_bound.measure(
            fast_shape, data, args.nproc, threads, 0.2 if args.quick else kernel_bound.SECONDS
        )
        classic = run_classic(
            data,
            work,
            1,  # as the seeds run it: one process using every CPU
            system.available_cpus(),
            1 if args.quick else args.max_classic_epochs,
            args.target,
            args.classic_workers,
        )
        ref = {"preset": "reference", "epochs": 1, "batch_size": batch}
        ref_fp32 = run_ddppipe(
            "ddppipe, reference recipe, fp32",
            "ddppipe reference",
            kernel_bound.bench_config(
                args.nproc, threads, sha, **ref, precision="fp32", channels_last=False
            ),
            data,
            work,
        )
        ref_fast = run_ddppipe(
            "ddppipe, reference recipe + bf16 + channels_last",
            "ddppipe reference (bf16)",
            kernel_bound.bench_config(args.nproc, threads, sha, **ref, **speed),
            data,
            work,
        )
        fast = []
        for seed in range(1 if args.quick else args.seeds):
            fast_cfg = kernel_bound.bench_config(
                args.nproc, threads, sha, preset="fast", seed=seed, **epochs
            )
            t = fast_cfg["train"]
            fast.append(run_ddppipe(
                f"ddppipe fast preset seed {seed}",
                f"ddppipe fast, seed {seed}: {t['optimizer']} {t['schedule']} lr {t['lr']}, "
                f"label smoothing {t['label_smoothing']}, global batch {t['batch_size']}, "
                f"{t['epochs']} epochs, {t['precision']}"
                f"{', channels_last' if t['channels_last'] else ''}",
                fast_cfg, data, work,
            ))  # fmt: skip

    runs = [classic, ref_fp32, ref_fast, *fast]
    print(
        f"\nddppipe benchmark{' (--quick: tiny data, not figures)' if args.quick else ''}: "
        f"{args.nproc} processes x {threads} thread(s), {machine()}"
    )
    print(
        "load average (1 min) before/after each run: "
        + ", ".join(f"{r.name}: {r.load_before:.1f}/{r.load_after:.1f}" for r in runs)
    )
    print("\n(a) training throughput\n")
    print(throughput_table(classic, [ref_fp32, ref_fast]))
    print(
        f"\n(b) wall time from launch to >= {100 * args.target:.1f} % test accuracy "
        "(start-up, data loading and per-epoch evaluation included)\n"
    )
    print(time_table(classic, fast, args.target))
    print("\n(c) the goals\n")
    print(goals(classic, fast, args.target, peak, bound, args.nproc))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "machine": machine(),
                    "nproc": args.nproc,
                    "threads": threads,
                    "target": args.target,
                    "quick": args.quick,
                    "bf16_gemm_peak_gflops": peak,
                    "kernel_bound_gflops": bound,
                    "runs": [asdict(r) | {"images_per_s": r.images_per_s} for r in runs],
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
