"""FSDP against DDP on CPUs (2 processes, gloo): memory per rank, step time, and how long an
asynchronous sharded checkpoint blocks training.

Runs ddppipe's byte-level transformer (``ddppipe.tasks.charlm``) and prints:

- (a) each rank's bytes of parameters + gradients + optimizer state (AdamW), FSDP / DDP
  (target <= 0.55x);
- (b) the median step time of a model both fit, FSDP / DDP (target <= 1.3x);
- (c) a model of >= 100 M parameters (FSDP): the time training is blocked by an asynchronous
  save (:class:`ddppipe.training.checkpoints.sharded_checkpoint.Store`: staging, then the
  write in the background) against a synchronous one (the same save, waited for) (target
  <= 10 %).

    python bench/fsdp.py                 # d_model 256 x 8 layers for (a)/(b), 1024 x 8 for (c)
    python bench/fsdp.py --quick         # small models (a smoke run)
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small models")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per strategy")
    ap.add_argument("--checkpoint-only", action="store_true", help="(c) alone")
    return ap.parse_args(argv)


def lm(d_model: int, layers: int, context: int = 64) -> torch.nn.Module:
    from ddppipe.tasks import charlm

    args = {"context": context, "d_model": d_model, "layers": layers, "heads": 4}
    return charlm.model(args)


def local_bytes(tensors: Any) -> int:
    """Bytes this rank holds of ``tensors`` (a DTensor's local shard)."""
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def held_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values()]
    return {"params": local_bytes(params), "grads": local_bytes(p.grad for p in params),
            "optimizer": local_bytes(state)}  # fmt: skip


def wrapped(strategy: str, model: torch.nn.Module) -> torch.nn.Module:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddppipe.parallel import fsdp

    if strategy == "fsdp":
        return fsdp.shard(model, torch.device("cpu"), bf16=False)
    return DDP(model)


def train_steps(d_model: int, layers: int, strategy: str, steps: int) -> dict[str, Any]:
    """(Every rank) ``steps`` timed AdamW steps of a batch of 8 windows of 64 bytes a rank."""
    from ddppipe.tasks import charlm

    torch.manual_seed(0)
    net = wrapped(strategy, lm(d_model, layers))
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (8, 64))
    times = []
    for i in range(steps + 2):  # 2 warm-up steps
        dist.barrier()
        start = time.perf_counter()
        charlm.loss(net(x), x).backward()
        optimizer.step()
        if i == steps + 1:
            held = held_bytes(net, optimizer)  # before the gradients are dropped
        optimizer.zero_grad(set_to_none=True)
        if i >= 2:
            times.append(time.perf_counter() - start)
    return {"step_s": statistics.median(times), "held": held}


def checkpoint_block(d_model: int, layers: int, folder: Path) -> dict[str, float]:
    """(Every rank) An FSDP model's first optimizer step, then a sharded save waited for at
    once (synchronous) and one whose background write overlaps a stand-in for training."""
    from ddppipe.training.checkpoints import sharded_checkpoint

    torch.manual_seed(0)
    net = wrapped("fsdp", lm(d_model, layers))
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (2, 64))
    from ddppipe.tasks import charlm

    charlm.loss(net(x), x).backward()
    optimizer.step()
    store = sharded_checkpoint.Store(folder, keep=2, group=dist.new_group(backend="gloo"))
    figures: dict[str, float] = {}
    import torch.distributed.checkpoint as dcp

    for step, mode in enumerate(("dcp", "sync", "async") * 2):
        state = {"config_hash": "bench", "epoch": 0, "step": step, "scheduler": {}, "rng": [],
                 "history": [], "meta": {}}  # fmt: skip
        dist.barrier()
        start = time.perf_counter()
        if mode == "dcp":  # plain dcp.save: written from the tensors themselves, no copy
            plain = str(folder / f"plain-{step}")
            dcp.save(sharded_checkpoint.tensors_of(net, optimizer), checkpoint_id=plain,
                     process_group=store.group)  # fmt: skip
            figures["dcp_s"] = time.perf_counter() - start
            continue
        store.save(state, sharded_checkpoint.tensors_of(net, optimizer))
        if mode == "sync":
            store.wait()
        blocked = time.perf_counter() - start
        if mode == "async":  # training goes on meanwhile; then the write completes
            store.wait()
        figures[f"{mode}_s"] = blocked  # the second of each counts (warm)
        figures[f"{mode}_total_s"] = time.perf_counter() - start
    return figures


def worker(rank: int, world: int, port: int, job: dict[str, Any], out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        if job["kind"] == "train":
            result = train_steps(job["d_model"], job["layers"], job["strategy"], job["steps"])
        else:
            result = checkpoint_block(job["d_model"], job["layers"], Path(job["folder"]))
        if rank == 0:
            out.put(result)
    finally:
        dist.destroy_process_group()


def run(job: dict[str, Any], world: int = 2) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=worker, args=(r, world, port, job, out)) for r in range(world)]
    for p in procs:
        p.start()
    result = out.get(timeout=3600)
    for p in procs:
        p.join()
    return result


def parameters(d_model: int, layers: int) -> int:
    return sum(p.numel() for p in lm(d_model, layers).parameters())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    small, big = ((64, 2), (256, 2)) if args.quick else ((256, 8), (1024, 8))
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model_name = next((line.split(":", 1)[1].strip() for line in cpu.splitlines()
                       if line.startswith("Model name")), platform.processor())  # fmt: skip
    print(f"{time.strftime('%Y-%m-%d')}, {model_name}, {os.cpu_count()} CPUs, torch "
          f"{torch.__version__}, 2 processes, gloo")  # fmt: skip
    if not args.checkpoint_only:
        train_figures(small, args.steps)
    checkpoint_figures(big)
    return 0


def train_figures(small: tuple[int, int], steps: int) -> None:
    n = parameters(*small)
    figures = {s: run({"kind": "train", "strategy": s, "d_model": small[0], "layers": small[1],
                       "steps": steps}) for s in ("ddp", "fsdp")}  # fmt: skip
    print(f"\n(a) bytes a rank holds, charlm d_model {small[0]} x {small[1]} layers "
          f"({n / 1e6:.1f} M parameters), AdamW, fp32")  # fmt: skip
    for strategy, f in figures.items():
        held = f["held"]
        parts = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in held.items())
        print(f"  {strategy:4s}: {sum(held.values()) / 2**20:7.1f} MiB ({parts})")
    ratio = sum(figures["fsdp"]["held"].values()) / sum(figures["ddp"]["held"].values())
    print(f"  fsdp / ddp: {ratio:.2f}x (target <= 0.55x)")
    print(f"\n(b) median step time, batch 8 x 64 bytes a rank, {steps} steps")
    for strategy, f in figures.items():
        print(f"  {strategy:4s}: {f['step_s'] * 1000:.1f} ms")
    ratio = figures["fsdp"]["step_s"] / figures["ddp"]["step_s"]
    print(f"  fsdp / ddp: {ratio:.2f}x (target <= 1.3x)")


def checkpoint_figures(big: tuple[int, int]) -> None:
    n = parameters(*big)
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as folder:
        f = run({"kind": "checkpoint", "d_model": big[0], "layers": big[1], "folder": folder})
    print(f"\n(c) sharded checkpoint of charlm d_model {big[0]} x {big[1]} layers "
          f"({n / 1e6:.1f} M parameters + AdamW state), fsdp")  # fmt: skip
    print(f"  plain synchronous dcp.save:                {f['dcp_s']:.2f} s")
    print(f"  synchronous save (written and committed): {f['sync_s']:.2f} s")
    print(f"  asynchronous save, training blocked:       {f['async_s']:.2f} s "
          f"(written and committed after {f['async_total_s']:.2f} s)")  # fmt: skip
    print(f"  blocked / synchronous: {f['async_s'] / f['sync_s']:.0%} (target <= 10 %); "
          f"blocked / plain dcp.save: {f['async_s'] / f['dcp_s']:.0%}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
