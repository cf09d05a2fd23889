"""What the local DAG costs outside training: `make run`'s overhead, measured, rule by rule.

Runs the default DAG (`snakemake --cores all`, as `make run` does) in a scratch folder on
MNIST served from a local mirror, 1 epoch unless told otherwise, then prints:

- the DAG's wall time, and inside it the training and per-epoch evaluation time that rank 0
  measured (the slot's attempt record), the slot's start-up, and what is left: the overhead;
- each rule's own wall time (Snakemake's `benchmark:` files, where the rule has one).

    python bench/overhead.py                                  # ../shared/data/mnist, 1 epoch
    python bench/overhead.py --mirror /path/to/mnist --epochs 3
    python bench/overhead.py --quick                          # tiny generated data (CI smoke)
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
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
SHARED_MNIST = REPO.parent / "shared" / "data" / "mnist"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mirror", type=Path, default=SHARED_MNIST, help="folder of the *.gz files")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="tiny generated data, 1 epoch")
    ap.add_argument("--keep", type=Path, help="run in this folder and keep it")
    return ap.parse_args(argv)


def sha256sums(mirror: Path) -> dict[str, str]:
    sums = {}
    for line in (mirror / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split()
        sums[name.removesuffix(".gz")] = digest
    return sums


def config_for(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    cfg["run"] = "overhead"
    cfg["train"]["epochs"] = 1 if args.quick else args.epochs
    if args.quick:
        sys.path.insert(0, str(REPO))
        from tests.tiny import make_tiny

        tiny = make_tiny(work / "tiny")
        cfg["task_args"] = {"mirrors": [tiny.mirror_url], "sha256": tiny.sha256}
        cfg["train"]["batch_size"] = 32
    else:
        cfg["task_args"] = {"mirrors": [args.mirror.resolve().as_uri() + "/"],
                            "sha256": sha256sums(args.mirror)}  # fmt: skip
    return cfg


def rule_seconds(work: Path) -> dict[str, float]:
    """Wall seconds of each rule that has a benchmark file (the first run's line)."""
    found = {}
    for tsv in sorted(work.glob("benchmarks/**/*.tsv")):
        header, first = tsv.read_text().splitlines()[:2]
        found[tsv.stem] = float(dict(zip(header.split("\t"), first.split("\t"), strict=True))["s"])
    return found


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ddppipe-overhead-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        cfg = config_for(args, work)
        (work / "config.yaml").write_text(yaml.safe_dump(cfg))
        bindir = str(Path(sys.executable).parent)
        started = time.monotonic()
        result = subprocess.run(
            [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(work),
             "--configfile", str(work / "config.yaml"), "--cores", "all"],
            cwd=work, capture_output=True, text=True, check=False,
            env={**os.environ, "PATH": f"{bindir}:{os.environ.get('PATH', '/usr/bin:/bin')}"},
        )  # fmt: skip
        wall = time.monotonic() - started
        if result.returncode != 0:
            print(result.stdout[-3000:], result.stderr[-3000:], file=sys.stderr)
            return 1
        (attempt,) = json.loads((work / "results/overhead/train/attempts.json").read_text())
        figures = attempt["efficiency"]
        training = figures["train_s"] + figures.get("evaluate_s", 0.0)
        data = "tiny data" if args.quick else "MNIST"
        print(f"ddppipe DAG overhead, {time.strftime('%Y-%m-%d')}, {platform.node()}, "
              f"{cfg['train']['epochs']} epoch(s), {data}")  # fmt: skip
        print(f"  DAG wall (snakemake --cores all)       {wall:7.1f} s")
        print(f"  training + per-epoch evaluation        {training:7.1f} s  (rank 0's timers)")
        print(f"  of the slot: start-up to first step    {figures['startup_s']:7.1f} s")
        print(f"  outside training and evaluation        {wall - training:7.1f} s")
        print("  rules (their own wall time):")
        for rule, seconds in rule_seconds(work).items():
            print(f"    {rule:<22} {seconds:7.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
