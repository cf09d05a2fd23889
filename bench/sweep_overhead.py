"""What a sweep costs around its training: 8 one-epoch trials of the default MNIST config, locally.

Runs `snakemake --cores 2 sweep` on a grid of 8 trials (train.seed 0-7: the same work each)
in a scratch folder, MNIST served from a local mirror, then trains each trial again alone
(the train rule's command, `ddppipe launch`, with nothing else running) and prints:

- the sweep's wall time;
- the sum of the trials' training times, each trained alone (rank 0's training and
  per-epoch evaluation timers, the slot's attempt record);
- their ratio (issue #34 asks <= 1.1), and each rule's own wall time in the sweep; the same
  trainings' launch commands alone (their wall time: start-up and end too) and that ratio;
- where the sweep's time outside the trainings went, from the trials' attempt records: before
  the first slot's launcher started, in the slots around rank 0's timers (start-up to the
  first step, the final checkpoint and exit), between one slot's end and the next one's
  start, and after the last slot.

    python bench/sweep_overhead.py                        # ../shared/data/mnist, 8 trials
    python bench/sweep_overhead.py --trials 4 --cores 2
    python bench/sweep_overhead.py --quick                # tiny generated data, 2 trials
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

import overhead  # noqa: E402  (the single run's bench: its MNIST mirror and config)

SWEEP = "overhead"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--mirror", type=Path, default=overhead.SHARED_MNIST, help="folder of the *.gz files"
    )
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--cores", default="2", help="snakemake --cores (the issue's figure: 2)")
    ap.add_argument("--quick", action="store_true", help="tiny generated data, 2 trials")
    ap.add_argument("--keep", type=Path, help="run in this folder and keep it")
    return ap.parse_args(argv)


def config_for(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """bench/overhead.py's one-epoch config (real MNIST from the mirror, or tiny data), as
    the base of a sweep of ``args.trials`` seeds (the same work each)."""
    cfg = overhead.config_for(argparse.Namespace(**vars(args), epochs=1), work)
    cfg["run"] = "base"
    cfg["sweep"] = {"name": SWEEP, "parameters": {"train.seed": list(range(args.trials))}}
    return cfg


def run(cmd: list[str], work: Path) -> subprocess.CompletedProcess:
    bindir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": f"{bindir}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
    return subprocess.run(cmd, cwd=work, capture_output=True, text=True, check=False, env=env)


def training_s(attempts: Path) -> float:
    """Rank 0's training and per-epoch evaluation seconds, over the run's attempts."""
    return sum(a["efficiency"]["train_s"] + a["efficiency"].get("evaluate_s", 0.0)
               for a in json.loads(attempts.read_text()))  # fmt: skip


def alone(work: Path, trial: Path) -> tuple[float, float]:
    """Train ``trial`` again alone (its train rule's command, into a scratch state, started
    cold as one run alone starts); its training seconds and the command's wall seconds."""
    scratch = work / "alone" / trial.name
    scratch.mkdir(parents=True)
    started = time.monotonic()
    result = run([sys.executable, "-m", "ddppipe", "launch", "--config", str(trial / "config.yaml"),
                  "--data", "resources/mnist", "--state", str(scratch / "state"),
                  "--checkpoint", str(scratch / "final.pt"), "--metrics",
                  str(scratch / "metrics.jsonl"), "--attempts", str(scratch / "attempts.json"),
                  "--log", str(scratch / "train.log")], work)  # fmt: skip
    wall = time.monotonic() - started
    if result.returncode != 0:
        raise SystemExit(f"training {trial.name} alone failed:\n{result.stderr[-3000:]}")
    return training_s(scratch / "attempts.json"), wall


def breakdown(trials: list[Path], start: float, end: float) -> dict[str, float]:
    """The sweep's time outside rank 0's timers (Unix ``start`` to ``end``), from the slots'
    attempt records: before the first slot, around the timers in the slots (of which the
    start-up to the first step), between slots, after the last."""
    slots = sorted((a for t in trials for a in json.loads((t / "train/attempts.json").read_text())),
                   key=lambda a: a["start"])  # fmt: skip
    timers = [a["efficiency"]["train_s"] + a["efficiency"].get("evaluate_s", 0.0) for a in slots]
    return {
        "before the first slot": slots[0]["start"] - start,
        "in the slots, around rank 0's timers": sum(
            a["end"] - a["start"] - t for a, t in zip(slots, timers, strict=True)
        ),
        "  of which start-up to the first step": sum(a["efficiency"]["startup_s"] for a in slots),
        "between slots (one's end, the next's start)": sum(
            max(0.0, b["start"] - a["end"]) for a, b in itertools.pairwise(slots)
        ),
        "after the last slot": end - max(a["end"] for a in slots),
    }


def rule_seconds(work: Path) -> dict[str, list[float]]:
    """Wall seconds of each rule with a benchmark file, one per job."""
    found: dict[str, list[float]] = defaultdict(list)
    for tsv in sorted(work.glob("benchmarks/**/*.tsv")):
        header, first = tsv.read_text().splitlines()[:2]
        found[tsv.stem].append(float(dict(zip(header.split("\t"), first.split("\t"),
                                                  strict=True))["s"]))  # fmt: skip
    return found


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.quick:
        args.trials = 2
    with tempfile.TemporaryDirectory(prefix="ddppipe-sweep-overhead-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        cfg = config_for(args, work)
        (work / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        snakemake = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d",
                     str(work), "--configfile", str(work / "config.yaml")]  # fmt: skip
        # The data first, so that neither figure has its preparation in it.
        prepared = run([*snakemake, "--cores", args.cores, "resources/mnist/manifest.json"], work)
        if prepared.returncode != 0:
            print(prepared.stdout[-3000:], prepared.stderr[-3000:], file=sys.stderr)
            return 1
        started, unix_start = time.monotonic(), time.time()
        result = run([*snakemake, "--cores", args.cores, "sweep"], work)
        wall, unix_end = time.monotonic() - started, time.time()
        if result.returncode != 0:
            print(result.stdout[-3000:], result.stderr[-3000:], file=sys.stderr)
            return 1
        trials = sorted(p.parent for p in (work / "results/sweeps" / SWEEP).glob("*/config.yaml"))
        in_sweep = [training_s(t / "train" / "attempts.json") for t in trials]
        each, walls = zip(*(alone(work, t) for t in trials), strict=True)
        total = sum(each)
        data = "tiny data" if args.quick else "MNIST"
        print(f"ddppipe sweep overhead, {time.strftime('%Y-%m-%d')}, {platform.node()}, "
              f"{os.cpu_count()} CPUs, snakemake --cores {args.cores}, {len(trials)} one-epoch "
              f"trials, {data}")  # fmt: skip
        print(f"  sweep wall (snakemake sweep)            {wall:7.1f} s")
        print(f"  sum of training, each trained alone     {total:7.1f} s  (rank 0's timers; "
              f"{statistics.mean(each):.1f} s a trial)")  # fmt: skip
        print(f"  the same, each run alone: launch's wall  {sum(walls):7.1f} s  (its start-up "
              f"and end too: {sum(walls) / len(walls):.1f} s a trial, cold)")  # fmt: skip
        print(f"  the same trials' training in the sweep  {sum(in_sweep):7.1f} s")
        print(
            f"  ratio wall / training alone             {wall / total:7.2f}   (issue #34: <= 1.1)"
        )
        print(f"  ratio wall / launch alone               {wall / sum(walls):7.2f}")
        print("  the sweep's time outside the trainings (the slots' attempt records):")
        for what, seconds in breakdown(trials, unix_start, unix_end).items():
            print(f"    {what:<44} {seconds:6.1f} s")
        print("  rules in the sweep (their own wall time, mean over jobs):")
        for rule, seconds in rule_seconds(work).items():
            print(f"    {rule:<22} {statistics.mean(seconds):7.1f} s x {len(seconds)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
