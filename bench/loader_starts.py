"""Many epoch starts of a small map-style task with DataLoader workers, in a rank whose other
threads are busy: does a loader start hang? (issue 52, ``ddppipe.data.loader``)

Each process is one rank pinned to one CPU (``taskset``), one DataLoader worker, running
what a training rank runs beside its loop: a thread saving a checkpoint (``torch.save``) over
and over, a thread logging, a heartbeat thread, and OpenMP in the main thread. Every epoch
trains one pass of a 512-sample dataset read item by item and evaluates a 128-sample one.

- ``--mode fresh``: a new DataLoader per epoch and per evaluation, forking its workers from
  the threaded rank each time (ddppipe before issue 52);
- ``--mode kept``: ddppipe's ``batches.Feed``: the workers forked once, kept for every pass.

A pass whose batch does not come within ``--timeout`` seconds is a hang: the worker's Python
and native stacks (``py-spy dump --native``) are printed and the process ends.

    python bench/loader_starts.py --mode kept --seconds 240 --ranks 2
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

from ddppipe.data import batches

CPU = torch.device("cpu")


class Items(Dataset):
    """Map-style, per-item Python (as an image folder is)."""

    def __init__(self, n: int) -> None:
        self.x, self.y = torch.randn(n, 64), torch.randint(0, 10, (n,))

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] * 2, self.y[i]


def busy_threads(stop: threading.Event) -> None:
    """A checkpoint saved over and over, a logger, a heartbeat: what a rank runs beside."""

    def saver() -> None:
        state = {"w": torch.randn(256, 256)}
        while not stop.is_set():
            torch.save(state, io.BytesIO())

    def logger() -> None:
        log = logging.getLogger("busy")
        log.addHandler(logging.StreamHandler(open(os.devnull, "w")))  # noqa: SIM115
        while not stop.is_set():
            log.warning("x" * 100)
            json.dumps({"a": list(range(50))})

    def heartbeat() -> None:
        while not stop.is_set():
            time.sleep(0.01)

    for target in (saver, logger, heartbeat):
        threading.Thread(target=target, daemon=True).start()


def fresh_passes(timeout: float) -> tuple:
    """A new DataLoader (and its workers) for each pass."""

    def train() -> None:
        for x, _ in DataLoader(Items(512), batch_size=128, shuffle=True, num_workers=1,
                               timeout=timeout):  # fmt: skip
            torch.mm(x, x.T)

    def evaluate() -> None:
        for _ in DataLoader(Items(128), batch_size=64, num_workers=1, timeout=timeout):
            pass

    return train, evaluate


def kept_passes(timeout: float) -> tuple:
    """ddppipe's feeds: workers forked once, kept."""
    bound = lambda longest: timeout  # noqa: E731
    train_feed = batches.Feed(Items(512), CPU, 1, seeded=True, wait_bound=bound).start()
    test_feed = batches.Feed(Items(128), CPU, 1, wait_bound=bound).start()
    epoch = [0]

    def train() -> None:
        for (x, _), _size in train_feed.epoch(0, epoch[0], 128, 0, 1, 0):
            torch.mm(x, x.T)
        epoch[0] += 1

    def evaluate() -> None:
        for _ in test_feed.shard(0, 1, 64):
            pass

    return train, evaluate


def one_rank(mode: str, seconds: float, timeout: float) -> None:
    stop = threading.Event()
    busy_threads(stop)
    train, evaluate = (fresh_passes if mode == "fresh" else kept_passes)(timeout)
    starts, began = 0, time.monotonic()
    try:
        while time.monotonic() - began < seconds:
            train()
            evaluate()
            starts += 2
    except RuntimeError as e:  # (LoaderStalled is one too)
        print(json.dumps({"pid": os.getpid(), "passes": starts, "hang": str(e)[:300]}), flush=True)
        for child in subprocess.run(["pgrep", "-P", str(os.getpid())], capture_output=True,
                                    text=True).stdout.split():  # fmt: skip
            dump = ["py-spy", "dump", "--native", "--pid", child]
            print(subprocess.run(dump, capture_output=True, text=True).stdout, flush=True)
        os._exit(3)
    stop.set()
    print(json.dumps({"pid": os.getpid(), "passes": starts, "hang": None,
                      "seconds": round(time.monotonic() - began)}), flush=True)  # fmt: skip
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("fresh", "kept"), default="kept")
    parser.add_argument("--seconds", type=float, default=240.0)
    parser.add_argument("--timeout", type=float, default=20.0)
    parser.add_argument("--ranks", type=int, default=1, help="processes, each on its own CPU")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        one_rank(args.mode, args.seconds, args.timeout)
    cpus = sorted(os.sched_getaffinity(0))
    procs = []
    for r in range(args.ranks):
        command = ["taskset", "-c", str(cpus[r % len(cpus)]), sys.executable,
                   str(Path(__file__).resolve()), "--one", "--mode", args.mode,
                   "--seconds", str(args.seconds), "--timeout", str(args.timeout)]  # fmt: skip
        procs.append(subprocess.Popen(command, stdout=subprocess.PIPE, text=True))
    results = [json.loads(p.communicate()[0].splitlines()[0]) for p in procs]
    passes = sum(r["passes"] for r in results)
    hangs = sum(r["hang"] is not None for r in results)
    print(f"{args.mode}: {passes} loader passes ({args.ranks} rank(s), one CPU and one worker "
          f"each, {args.seconds:.0f} s), {hangs} hang(s)")  # fmt: skip
    for r in results:
        print(" ", json.dumps(r))


if __name__ == "__main__":
    main()
