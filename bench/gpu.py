"""ddppipe on this machine's GPUs: real MNIST, the `fast` preset, NCCL. Prints figures.

    python bench/gpu.py --mirror file:///path/to/mnist/     # one process per GPU

Downloads (checksum-verified) from the mirror, trains with ``ddppipe launch`` (torchrun, one
process per visible GPU, NCCL), and prints the stack, per-epoch times and test accuracy, the
training processes' peak host memory (what ``slurm.mem_mb`` must cover per GPU), and the
preflight's NCCL all-reduce bus bandwidth.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

from ddppipe import config, download, provenance

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mirror", required=True, help="MNIST mirror URL (file:// works)")
    parser.add_argument("--procs", type=int, default=torch.cuda.device_count())
    parser.add_argument("--epochs", type=int, default=None, help="default: the preset's")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA GPU here: nothing to measure", file=sys.stderr)
        return 1
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    cfg["task_args"]["mirrors"] = [args.mirror]
    cfg["launch"].update(nproc_per_node=args.procs, device="gpu")
    cfg["train"]["epochs"] = args.epochs
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = work / "mnist"
        download.download_all(cfg["data"], data)
        resolved = work / "config.yaml"
        config.write(config.resolve(cfg), resolved)
        command = [
            sys.executable, "-m", "ddppipe", "launch", f"--config={resolved}", f"--data={data}",
            f"--state={work / 'state'}", f"--checkpoint={work / 'final.pt'}",
            f"--metrics={work / 'metrics.jsonl'}",
        ]  # fmt: skip
        started = time.perf_counter()
        subprocess.run(command, check=True)
        wall = time.perf_counter() - started
        peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        epochs = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
        bandwidth = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             f"--nproc-per-node={args.procs}", "-m", "ddppipe", "preflight-allreduce",
             "--use=gpu"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
    stack = provenance.software()
    print(f"stack: {json.dumps(stack)}")
    print(f"processes: {args.procs} (NCCL), preset fast, wall {wall:.1f} s from launch")
    print(f"{'epoch':>5} {'seconds':>8} {'images/s':>9} {'test acc':>9}")
    for e in epochs:
        print(
            f"{e['epoch']:>5} {e['epoch_seconds']:>8.2f} {e['images_per_s']:>9.0f} "
            f"{e['test_accuracy']:>9.4f}"
        )
    print(f"peak host memory of one training process: {peak_mb:.0f} MB")
    print(f"preflight: {bandwidth}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
