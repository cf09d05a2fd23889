"""How soon a `tpe` sweep's next trial starts once a slot frees: locally, digits, 2 at once.

Runs `snakemake --cores 2 sweep` of a tpe sweep (``--trials`` trials of the digits task,
``max_parallel`` 2, ``--epochs`` epochs each) in a scratch folder and prints, for every trial
after the first two, the seconds from the end of the training whose slot it takes (the trial
i, suggested by round i - 1, takes the slot freed by the (i - 1)-th of the trials before it to
end) to the start of its own training (its attempt's start), and the largest of them. Before
slot-wise suggestions a round of ``max_parallel`` trials waited for the slowest trial of the
round before it.

    python bench/sweep_tpe.py                  # 8 trials of 5 epochs
    python bench/sweep_tpe.py --trials 6 --epochs 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--keep", type=Path, help="run in this folder and keep it")
    ap.add_argument("--scheduler", default=None, help="snakemake --scheduler (ilp, greedy)")
    args = ap.parse_args(argv)
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    cfg.update(run="base", task="ddppipe.tasks.digits", task_args={"width": 8})
    cfg["train"].update(epochs=args.epochs, batch_size=64)
    cfg["launch"].update(nproc_per_node=1, cpus_per_proc=1, device="cpu")
    lr = {"low": 0.005, "high": 0.2, "log": True}
    cfg["sweep"] = {"name": "tpe", "method": "tpe", "trials": args.trials, "max_parallel": 2,
                    "parameters": {"train.lr": lr}}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="ddppipe-sweep-tpe-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        (work / "config.yaml").write_text(yaml.safe_dump(cfg))
        bindir = str(Path(sys.executable).parent)
        env = {**os.environ, "PATH": f"{bindir}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
        started = time.monotonic()
        result = subprocess.run(
            [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(work),
             "--configfile", str(work / "config.yaml"), "--cores", "2", "sweep",
             *(["--scheduler", args.scheduler] if args.scheduler else [])],
            cwd=work, capture_output=True, text=True, check=False, env=env,
        )  # fmt: skip
        wall = time.monotonic() - started
        if result.returncode != 0:
            print(result.stderr[-4000:], file=sys.stderr)
            return 1
        rounds = [
            json.loads(r.read_text())
            for r in sorted(
                (work / "results/sweeps/tpe/rounds").glob("*.json"), key=lambda p: int(p.stem)
            )
        ]
        order = [t["name"] for r in rounds for t in r["trials"]]
        attempt = {n: json.loads((work / f"results/sweeps/tpe/{n}/train/attempts.json")
                                 .read_text())[0] for n in order}  # fmt: skip
        # trial i (round i - 1) takes the slot freed by the (i - 1)-th trial before it to end
        freed_by = {order[i]: sorted(order[:i], key=lambda n: attempt[n]["end"])[i - 2]
                    for i in range(2, len(order))}  # fmt: skip
        gaps = [attempt[order[i]]["start"] - attempt[freed_by[order[i]]]["end"]
                for i in range(2, len(order))]  # fmt: skip
        print(f"ddppipe tpe sweep, {time.strftime('%Y-%m-%d %H:%M')}, {platform.node()}, "
              f"{os.cpu_count()} CPUs; {len(order)} trials of {args.epochs} epoch(s), 2 at once, "
              f"wall {wall:.0f} s")  # fmt: skip
        for i, gap in enumerate(gaps, start=2):
            before = order.index(freed_by[order[i]])
            took = attempt[order[before]]["end"] - attempt[order[before]]["start"]
            print(f"  trial {i}: started {gap:4.1f} s after trial {before} ended and freed its "
                  f"slot (which trained {took:.1f} s)")  # fmt: skip
        print(f"  slot freed -> next trial's training: median {statistics.median(gaps):.1f} s, "
              f"at most {max(gaps):.1f} s (issue #34: within 2 s)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
