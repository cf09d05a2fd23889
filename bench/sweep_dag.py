"""How long the DAG of a 1,000-trial grid sweep takes to build and dry-run (issue #27: <= 30 s).

Writes the default config with a grid of 1,000 trials (train.lr: 10 values x train.seed: 100
values) into a scratch folder and times `snakemake -n sweep` there (parse, every trial's
config, the DAG of every trial's jobs, the dry run's listing), then prints the seconds and the
number of jobs.

    python bench/sweep_dag.py                  # 1,000 trials
    python bench/sweep_dag.py --seeds 10       # 100 trials
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
LRS = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=100, help="values of train.seed (x 10 lr)")
    args = ap.parse_args(argv)
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    grid = {"train.lr": LRS, "train.seed": list(range(args.seeds))}
    cfg["sweep"] = {"name": "big", "parameters": grid}
    trials = len(LRS) * args.seeds
    with tempfile.TemporaryDirectory(prefix="ddppipe-sweep-dag-") as tmp:
        work = Path(tmp)
        (work / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        bindir = str(Path(sys.executable).parent)
        started = time.monotonic()
        result = subprocess.run(
            [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(work),
             "--configfile", str(work / "config.yaml"), "-n", "--cores", "2", "sweep",
             "--quiet", "rules"],
            cwd=work, capture_output=True, text=True, check=False,
            env={**os.environ, "PATH": f"{bindir}:{os.environ.get('PATH', '/usr/bin:/bin')}"},
        )  # fmt: skip
        seconds = time.monotonic() - started
    if result.returncode != 0:
        print(result.stdout[-3000:], result.stderr[-3000:], file=sys.stderr)
        return 1
    jobs = int(re.findall(r"^total\s+(\d+)$", result.stdout, re.M)[-1])
    print(f"ddppipe sweep DAG, {time.strftime('%Y-%m-%d')}, {platform.node()}, "
          f"{os.cpu_count()} CPUs")  # fmt: skip
    print(f"  {trials} trials, {jobs} jobs: built and dry-run in {seconds:.1f} s "
          "(issue #27: <= 30 s)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
