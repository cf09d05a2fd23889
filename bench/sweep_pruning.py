"""What pruning saves: the same sweep with ``prune: median`` and with ``prune: none``.

Runs one grid of learning rates twice through the local DAG (``snakemake --cores all sweep``),
each in its own scratch folder, one trial at a time (``max_parallel: 1``): one rate that learns
and several that cannot. Prints, for each sweep, every trial's outcome and cost, and the
totals: CPU-hours held by the trainings' slots (the attempt records' figures, what the
sweep's table and the summaries report), CPU-hours spent training, wall time, and the best
trial (the same in both, or the saving is no saving).

    python bench/sweep_pruning.py                        # digits, 20 epochs of batch 32
    python bench/sweep_pruning.py --epochs 10 --lrs 0.006 1e-5 2e-5 3e-5
    python bench/sweep_pruning.py --task ddppipe.tasks.mnist --epochs 3 --batch-size 128

The order in which Snakemake starts the trials decides what the median rule can compare a
trial with (only finished trials count): a hopeless trial that runs before any other
completes; the others after it are pruned.
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

from ddppipe.reports import hours, run_files
from ddppipe.settings import layout

REPO = Path(__file__).resolve().parents[1]

SWEEP = "lr"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="ddppipe.tasks.digits")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--procs", type=int, default=2, help="training processes a trial")
    ap.add_argument("--lrs", type=float, nargs="+", default=[0.006, 1e-5, 2e-5, 3e-5])
    ap.add_argument("--keep", type=Path, help="run in this folder and keep it")
    return ap.parse_args(argv)


def config_for(args: argparse.Namespace, prune: str) -> dict[str, Any]:
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    cfg.update(task=args.task, task_args={})
    cfg["train"].update(epochs=args.epochs, batch_size=args.batch_size)
    cfg["launch"].update(nproc_per_node=args.procs, cpus_per_proc=1)
    cfg["sweep"] = {"name": SWEEP, "parameters": {"train.lr": args.lrs}, "max_parallel": 1,
                    "prune": prune}  # fmt: skip
    return cfg


def run_sweep(work: Path, cfg: dict[str, Any]) -> float:
    """``snakemake --cores all sweep`` in ``work``: its wall seconds."""
    work.mkdir(parents=True, exist_ok=True)
    for name in ("Snakefile", "workflow", "config", "src", "pyproject.toml"):
        if not (work / name).exists():
            (work / name).symlink_to(REPO / name)
    (work / "bench.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "--cores", "all", "sweep", "--configfile",
         "bench.yaml"], cwd=work, env=env, capture_output=True, text=True,
    )  # fmt: skip
    if proc.returncode != 0:
        sys.exit(f"snakemake failed in {work}:\n{proc.stderr[-4000:]}")
    return time.monotonic() - started


def trials(work: Path) -> list[dict[str, Any]]:
    """Each trial's outcome, final accuracy and cost, from its run's files."""
    found = []
    for root in sorted((work / layout.RESULTS / layout.SWEEPS / SWEEP).glob("lr=*")):
        files = run_files.load(root)
        cost = hours.Cost.of(files.about.spec, files.attempts)
        pruned = files.evaluation.get("pruned_at_epoch")
        found.append({
            "trial": root.name,
            "outcome": f"pruned at epoch {pruned}" if pruned else "completed",
            "accuracy": files.evaluation["test_accuracy"],
            "held_h": cost.held_h if cost else 0.0,
            "training_h": cost.training_h if cost else 0.0,
            "started": files.attempts[0]["start"],
        })  # fmt: skip
    return sorted(found, key=lambda t: t["started"])


def report(name: str, wall: float, found: list[dict[str, Any]]) -> dict[str, Any]:
    print(f"\nprune: {name} (trials in the order they ran; wall {wall:.0f} s)")
    for t in found:
        held_s, training_s = t["held_h"] * 3600, t["training_h"] * 3600
        print(f"  {t['trial']:<12} {t['outcome']:<18} accuracy {t['accuracy']:.4f}  "
              f"{held_s:7.1f} CPU-s held, {training_s:6.1f} training")  # fmt: skip
    best = max(found, key=lambda t: t["accuracy"])
    held, training = sum(t["held_h"] for t in found), sum(t["training_h"] for t in found)
    print(f"  total {held:.4f} CPU-hours held, {training:.4f} training; best {best['trial']} "
          f"({best['accuracy']:.4f})")  # fmt: skip
    return {"wall": wall, "held": held, "training": training, "best": best["trial"]}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="sweep-pruning-") as scratch:
        base = args.keep or Path(scratch)
        print(f"{platform.node()}, {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M')}: "
              f"{args.task}, {args.epochs} epochs of batch {args.batch_size}, {args.procs} "
              f"processes a trial, lr {args.lrs}, max_parallel 1")  # fmt: skip
        figures = {}
        for prune in ("median", "none"):
            work = base / prune
            wall = run_sweep(work, config_for(args, prune))
            figures[prune] = report(prune, wall, trials(work))
    pruned, full = figures["median"], figures["none"]
    same = "the same best trial" if pruned["best"] == full["best"] else "NOT the same best trial"
    print(f"\npruned sweep: {pruned['held']:.4f} CPU-hours held ({pruned['wall']:.0f} s wall), "
          f"unpruned: {full['held']:.4f} ({full['wall']:.0f} s): "
          f"{pruned['held'] / full['held']:.2f}x, {same}")  # fmt: skip
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
