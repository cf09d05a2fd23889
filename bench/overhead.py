"""What the local DAG costs outside training: `make run`'s overhead, measured, rule by rule.

Runs the default DAG (`snakemake --cores all`, as `make run` does) in a scratch folder on
MNIST served from a local mirror, 1 epoch unless told otherwise, then prints:

- the DAG's wall time, and inside it the training and per-epoch evaluation time that rank 0
  measured (the slot's attempt record), and what is left: the overhead, in parts: before the
  slot (Snakemake's start, the rules before training), the slot's start-up to its first step
  done (its parts: ddppipe.runstate.startup), the slot's end after its last evaluation, the
  rest of the slot around rank 0's timers, and after the slot (the rules after training);
- each rule's own wall time (Snakemake's `benchmark:` files, where the rule has one), and when
  the warm server (ddppipe.launching.warm) was ready.

    python bench/overhead.py                                  # ../shared/data/mnist, 1 epoch
    python bench/overhead.py --mirror /path/to/mnist --epochs 3
    python bench/overhead.py --quick                          # tiny generated data (CI smoke)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
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


def environment(bindir: str) -> dict[str, str]:
    """The DAG's environment: this one, the venv's commands first, and Python's bytecode cache
    on as on a user's machine (a shell that sets PYTHONDONTWRITEBYTECODE compiles each of
    ddppipe's modules again in every process)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return {**env, "PATH": f"{bindir}:{os.environ.get('PATH', '/usr/bin:/bin')}"}


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
        began, started = time.time(), time.monotonic()
        result = subprocess.run(
            [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(work),
             "--configfile", str(work / "config.yaml"), "--cores", "all"],
            cwd=work, capture_output=True, text=True, check=False,
            env=environment(bindir),
        )  # fmt: skip
        wall, ended = time.monotonic() - started, time.time()
        if result.returncode != 0:
            print(result.stdout[-3000:], result.stderr[-3000:], file=sys.stderr)
            return 1
        data = "tiny data" if args.quick else "MNIST"
        print(f"ddppipe DAG overhead, {time.strftime('%Y-%m-%d %H:%M')}, {platform.node()}, "
              f"load {os.getloadavg()[0]:.2f}, {cfg['train']['epochs']} epoch(s), "
              f"{data}")  # fmt: skip
        report(work, wall, began, ended)
    return 0


def report(work: Path, wall: float, began: float, ended: float) -> None:
    """The DAG's time outside training, in parts (the module's docstring)."""
    from ddppipe.runstate import startup

    (attempt,) = json.loads((work / "results/overhead/train/attempts.json").read_text())
    figures = attempt["efficiency"]
    training = figures["train_s"] + figures.get("evaluate_s", 0.0)
    parts = startup.of_attempt(attempt) or {"start-up to the first step": figures["startup_s"]}
    last_eval = json.loads((work / "results/overhead/train/metrics.jsonl").read_text()
                           .splitlines()[-1])["time"]  # fmt: skip
    before, start_up = attempt["start"] - began, sum(parts.values())
    slot_end, after = attempt["end"] - last_eval, ended - attempt["end"]
    first_step = parts.get(startup.FIRST_STEP, 0.0)  # (its training counted in train_s too)
    rest = wall - training - before - (start_up - first_step) - slot_end - after
    print(f"  DAG wall (snakemake --cores all)       {wall:7.1f} s")
    print(f"  training + per-epoch evaluation        {training:7.1f} s  (rank 0's timers)")
    print(f"  outside training and evaluation        {wall - training:7.1f} s:")
    print(f"    before the slot                      {before:7.1f} s  (Snakemake's start, "
          "the rules before training)")  # fmt: skip
    print(f"    the slot's start to its first step   {start_up:7.1f} s:")
    for name, seconds in parts.items():
        print(f"      {name:<20} {seconds:7.2f} s")
    print(f"    the slot's end after its last eval   {slot_end:7.1f} s  (final checkpoint, "
          "outputs, exit)")  # fmt: skip
    print(f"    the rest of the slot                 {rest:7.1f} s  (between rank 0's timers, "
          "less its first step)")  # fmt: skip
    print(f"    after the slot                       {after:7.1f} s  (the rules after "
          "training, the summary)")  # fmt: skip
    print("  rules (their own wall time):")
    for rule, seconds in rule_seconds(work).items():
        print(f"    {rule:<22} {seconds:7.1f} s")
    server = work / "logs" / "warm-server.log"
    text = server.read_text() if server.exists() else ""
    # (the log of a server kept between calls goes on: this call's part is after its last
    # start or adoption)
    start = max(text.rfind("warm server listening"), text.rfind("warm server adopted"))
    text = text[start:] if start >= 0 else ""
    listening = re.search(r"warm server listening after ([\d.]+) s", text)
    ready = re.search(r"warm ranks ready in ([\d.]+) s", text)
    if text.startswith("warm server adopted"):
        print("  warm server kept from an earlier call (adopted: its imports done)")
    elif listening and ready:
        print(f"  warm server listening {listening[1]} s after its start, its ranks' imports "
              f"done after {ready[1]} s")  # fmt: skip
    else:
        print("  no warm server")


if __name__ == "__main__":
    sys.exit(main())
