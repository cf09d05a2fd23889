"""What a DDP checkpoint blocks the training thread, its copy taken on that thread (DCP's
stager, as FSDP's shards are) or off it (``background_copy``: the copy overlaps the next
step's forward and backward, the optimizer step waits for it).

One process in a gloo group of one trains the default recipe's optimizer and schedule (AdamW,
one-cycle, fp32) on random MNIST-shaped batches, wrapped in DDP, and saves through the
training's own :class:`~ddppipe.training.loop.run_checkpoints.Checkpoints` every
``--between`` steps, ``--saves`` times a mode; each save's blocking is what the slot's
figures count (``save_costs``: starting the save, the next step's wait for the copy). The
previous save's write is waited for before each save, untimed: as when checkpoints come
minutes apart, not faster than they are written (else a save waits for the previous one:
``checkpoint_queued``). Models: the default MNIST CNN (BatchNorm, 4.6 MiB of weights) and
an MLP of ``--mlp-width`` (3.6 M parameters, 13.7 MiB at 1,536); AdamW's state doubles that.

Run with an older ddppipe on ``PYTHONPATH`` (before the copy went off the thread, no
``save_costs``), it measures that code's one mode, ``before``: the save call's seconds (all
that blocked its training thread).

    python bench/checkpoint_blocking.py                      # 10 saves a mode and model
    python bench/checkpoint_blocking.py --saves 20 --json out.json
    PYTHONPATH=<older checkout>/src python bench/checkpoint_blocking.py   # before
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml
from torch import nn

from ddppipe import tasks
from ddppipe.data import batches
from ddppipe.parallel import distributed, precision
from ddppipe.runstate.state import StateDir
from ddppipe.settings import run_spec
from ddppipe.training.checkpoints import checkpoint
from ddppipe.training.loop import optim, run_checkpoints, stepping, strategy

REPO = Path(__file__).resolve().parents[1]
COSTED = importlib.util.find_spec("ddppipe.training.measuring.save_costs") is not None


class OnThread(strategy.Replicated):
    """DDP as it saved before: DCP's stager copies the tensors on the training thread."""

    def copier(self, *args: Any) -> None:
        return None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--saves", type=int, default=10, help="saves a mode and model")
    ap.add_argument("--between", type=int, default=4, help="steps between two saves")
    ap.add_argument("--mlp-width", type=int, default=1536)
    ap.add_argument("--json", type=Path, help="write the figures here too")
    return ap.parse_args(argv)


def models(width: int) -> dict[str, nn.Module]:
    spec = default_spec()
    torch.manual_seed(0)
    mnist = tasks.load(spec.task).call("model", dict(spec.task_args))
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(784, width), nn.ReLU(),
                        nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))  # fmt: skip
    return {"mnist": mnist, "mlp": mlp}


def default_spec() -> run_spec.RunSpec:
    raw = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    return run_spec.resolve(raw, gpus=False)


def measure(name: str, model: nn.Module, copies: strategy.Strategy, args: argparse.Namespace,
            folder: Path) -> dict[str, Any]:  # fmt: skip
    """Train and save ``args.saves`` times; each save's blocking and the slot's figures."""
    spec, cpu = default_spec(), torch.device("cpu")
    torch.manual_seed(0)
    net = nn.parallel.DistributedDataParallel(model)
    optimizer = copies.optimizer(net.parameters(), spec.train, cpu)
    steps = args.saves * args.between + 8
    scheduler = optim.make_scheduler(optimizer, spec.train, steps)
    step = stepping.Stepper(net, optimizer, scheduler, nn.CrossEntropyLoss(), torch.float32,
                            torch.contiguous_format, 1)  # fmt: skip
    size = spec.train.batch_size
    batch = (torch.randn(size, 1, 28, 28), torch.randint(0, 10, (size,)))
    share = batches.Share(batch, size, size)
    ctx = distributed.Context(0, 0, 1, cpu, "gloo", "bench", 1)
    kept: dict[str, Any] = {}
    if COSTED:
        from ddppipe.training.measuring import save_costs

        kept["costs"] = save_costs.SaveCosts()
    saves = run_checkpoints.Checkpoints(
        spec, StateDir(folder), ctx, copies, checkpoint.Trainable(model, optimizer, scheduler),
        config_hash="bench", steps_per_epoch=steps, record=lambda **_: None,
        precision=precision.Decision("fp32", "fp32"), **kept,
    )  # fmt: skip
    for _ in range(4):  # warm-up: allocator, kernels
        step(share)
    plain = []
    for _ in range(args.between):
        started = time.perf_counter()
        step(share)
        plain.append(time.perf_counter() - started)
    blocked, at = [], 4 + args.between
    for _ in range(args.saves):
        saves.wait()  # (the previous write done: not timed)
        before, started = kept["costs"].blocked_s if COSTED else 0.0, time.perf_counter()
        saves.save(run_checkpoints.Position(0, at, []))
        call_s = time.perf_counter() - started
        for _ in range(args.between):  # the first one waits for the copy, if not done
            step(share)
        at += args.between  # (before: the call was all that blocked)
        blocked.append(kept["costs"].blocked_s - before if COSTED else call_s)
    saves.wait()
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    mode = "before" if not COSTED else "on the training thread" if isinstance(
        copies, OnThread) else "off the training thread"  # fmt: skip
    return {
        "model": name, "copy": mode, "weights_mb": weights / 2**20,
        "step_s": statistics.median(plain), "blocked_median_s": statistics.median(blocked),
        "blocked_max_s": max(blocked), "figures": kept["costs"].figures() if COSTED else {},
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)  # a rank's share of this 2-core machine
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    launch, rows = default_spec().launch, []
    for name in ("mnist", "mlp"):
        modes = (OnThread(launch), strategy.Replicated(launch)) if COSTED else (OnThread(launch),)
        for copies in modes:
            model = models(args.mlp_width)[name]  # (the same initial weights each time)
            with tempfile.TemporaryDirectory() as folder:
                rows.append(measure(name, model, copies, args, Path(folder)))
    dist.destroy_process_group()
    print(f"{'model':6} {'weights':>8} {'copy':24} {'step':>7} {'blocked/save (median, max)':>27}"
          f" {'copy':>7} {'write':>7}")  # fmt: skip
    for row in rows:
        fig = row["figures"]
        each = (f"{fig['checkpoint_copy_s'] / fig['checkpoints'] * 1e3:5.1f}ms "
                f"{fig['checkpoint_write_s'] / fig['checkpoints'] * 1e3:5.0f}ms"
                ) if fig else ""  # fmt: skip
        print(f"{row['model']:6} {row['weights_mb']:6.1f}MB {row['copy']:24} "
              f"{row['step_s'] * 1e3:5.1f}ms {row['blocked_median_s'] * 1e3:12.1f}ms "
              f"{row['blocked_max_s'] * 1e3:9.1f}ms {each}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
