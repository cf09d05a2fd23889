"""What `train.deterministic: true` costs, and how long `ddppipe reproduce` takes.

Trains generated MNIST-like data (tests/tiny.py) with the default recipe, 2 ranks, first as
configured and then with `train.deterministic: true`, alternating, ``--repeats`` times each;
prints rank 0's training seconds and images/s of each (the slot's attempt record, start-up
left out) and whether the two modes gave the same weights. Then times `ddppipe reproduce` of
the last default run, start-up included.

    python bench/determinism.py                     # 2,048 images, 2 epochs, 2 repeats
    python bench/determinism.py --images 8192 --repeats 3
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=2048, help="training images")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    return ap.parse_args(argv)


def ddppipe(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "ddppipe", *args]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, check=True)


def train(workdir: Path, cfg: dict[str, Any], run: str) -> dict[str, Any]:
    """Train and export results/<run>; its slot's efficiency figures."""
    from ddppipe.launching import resolve

    root, data = workdir / "results" / run, workdir / "resources" / "mnist"
    root.mkdir(parents=True)
    resolve.write_resolved({**cfg, "run": run}, root / "config.yaml", gpus=False)
    train_files = {n: root / "train" / n for n in ("final.pt", "attempts.json", "model.pt")}
    ddppipe("launch", f"--config={root / 'config.yaml'}", f"--data={data}",
            f"--state={root / 'state'}", f"--checkpoint={train_files['final.pt']}",
            f"--metrics={root / 'train/metrics.jsonl'}",
            f"--attempts={train_files['attempts.json']}", cwd=workdir)  # fmt: skip
    ddppipe("export", f"--result={train_files['model.pt']}",
            f"--record={root / 'train/final.json'}", f"--config={root / 'config.yaml'}",
            f"--data={data}", f"--out={root / 'export/model.pt'}",
            f"--provenance={root / 'export/provenance.json'}",
            f"--attempts={train_files['attempts.json']}", cwd=workdir)  # fmt: skip
    (attempt,) = json.loads(train_files["attempts.json"].read_text())
    return attempt["efficiency"]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    sys.path.insert(0, str(REPO))
    import os

    from tests.tiny import make_tiny, tiny_config

    workdir = Path(tempfile.mkdtemp(prefix="ddppipe-determinism-"))
    os.chdir(workdir)  # (the task check's record: resources/task-checks/)
    tiny = make_tiny(workdir / "tiny", n_train=args.images)
    shutil.copytree(tiny.data_dir, workdir / "resources" / "mnist")
    seconds: dict[bool, list[float]] = {False: [], True: []}
    for k in range(args.repeats):
        for deterministic in (False, True):
            cfg = tiny_config(tiny, epochs=args.epochs, deterministic=deterministic)
            figures = train(workdir, cfg, f"d{int(deterministic)}-{k}")
            seconds[deterministic].append(figures["train_s"])
            print(f"deterministic={deterministic}: train {figures['train_s']:.2f} s, "
                  f"{figures['images_per_s']:.0f} images/s", flush=True)  # fmt: skip
    default, exact = (statistics.median(seconds[m]) for m in (False, True))
    print(f"median training: default {default:.2f} s, deterministic {exact:.2f} s "
          f"({(exact / default - 1) * 100:+.1f} %)")  # fmt: skip
    same = len({hashlib.sha256((workdir / f"results/d{m}-0/export/model.pt").read_bytes()).digest()
                for m in (0, 1)}) == 1  # fmt: skip
    print(f"the two modes' model.pt: {'byte-identical' if same else 'different'}")
    started = time.monotonic()
    result = ddppipe("reproduce", f"results/d0-{args.repeats - 1}", cwd=workdir)
    print(f"ddppipe reproduce: {time.monotonic() - started:.1f} s, "
          f"verdict: {result.stdout.splitlines()[-1]}")  # fmt: skip
    shutil.rmtree(workdir)


if __name__ == "__main__":
    main()
