"""The most FLOP/s a training of a config's model can reach here: its step's kernels alone.

One training step of the config's model (its batch per rank, precision and memory format) is
recorded once; the operators that carry its FLOPs (convolutions, matrix products, forward and
backward, as ``torch.utils.flop_counter`` counts them) are then replayed with the step's own
tensors, again and again, on every training process at once (each bound to its CPUs as
training binds them), and nothing else: no batch norm, activation, pooling, loss, optimizer,
all-reduce or data. Their FLOP/s bound what the training itself can reach, and so its
fraction of the GEMM peak: everything else a step does only adds time.

    python bench/kernel_bound.py              # the default config's model, as the benchmark runs it
"""

from __future__ import annotations

import argparse
import multiprocessing
import queue
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml

from ddppipe import tasks
from ddppipe.core import system
from ddppipe.data import batches
from ddppipe.parallel import cpu_binding
from ddppipe.settings import config
from ddppipe.training.loop import evaluate

REPO = Path(__file__).resolve().parents[1]
SECONDS = 1.0  # replaying time per process, after a warm-up round

Call = tuple[Any, tuple[Any, ...], dict[str, Any]]


def _kept(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_kept(v) for v in value)
    return value


def record(step: Callable[[], None]) -> list[Call]:
    """The FLOP-carrying operator calls of ``step()``, with copies of their arguments."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import flop_registry

    class Recorder(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[Call] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func.overloadpacket in flop_registry:
                self.calls.append((func, _kept(args), _kept(kwargs)))
            return func(*args, **kwargs)

    with Recorder() as recorder:
        step()
    return recorder.calls


def replay(calls: list[Call]) -> None:
    for func, args, kwargs in calls:
        func(*args, **kwargs)


def flops(calls: list[Call]) -> int:
    """The FLOPs of one replay of ``calls``."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        replay(calls)
    return counter.get_total_flops()


def training_step(cfg: dict[str, Any], data_dir: Path, images: int) -> Callable[[], None]:
    """Forward and backward of ``images`` training samples through ``cfg``'s model, in its
    precision, memory format and loss, as :mod:`ddppipe.training.loop.train` runs a step on the
    CPU."""
    task = tasks.load(cfg["task"])
    train = cfg["train"]
    dtype, memory_format = evaluate.numerics(train["precision"], train["channels_last"])
    train_set, _ = task.call("datasets", data_dir, cfg["task_args"])
    batch = batches.samples(train_set, images, torch.device("cpu"))
    model = task.call("model", cfg["task_args"]).to(memory_format=memory_format)
    loss_fn = evaluate.training_loss(task, cfg["train"]["label_smoothing"])

    def step() -> None:
        evaluate.loss_of(model, batch, loss_fn, dtype, memory_format).backward()

    return step


def _process(cfg: dict[str, Any], data_dir: Path, rank: int, nproc: int, threads: int,
             seconds: float, barrier: Any, results: Any) -> None:  # fmt: skip
    """One training process's share: its kernels' FLOP/s, replayed while the others replay."""
    torch.set_num_threads(threads)
    cpu_binding.bind(rank, nproc, threads)
    calls = record(training_step(cfg, data_dir, cfg["train"]["batch_size"] // nproc))
    per_replay = flops(calls)  # also the warm-up round
    barrier.wait(timeout=300)  # a process that failed breaks it
    replays, started = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - started) < seconds:
        replay(calls)
        replays += 1
    results.put((rank, per_replay * replays / elapsed / 1e9))


def measure(cfg: dict[str, Any], data_dir: Path, nproc: int, threads: int,
            seconds: float = SECONDS) -> float:  # fmt: skip
    """GFLOP/s of ``cfg``'s step kernels alone on ``nproc`` processes of ``threads`` threads at
    once (their sum, like the GEMM peak of the preflight)."""
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(nproc), ctx.Queue()
    procs = [
        ctx.Process(target=_process,
                    args=(cfg, data_dir, rank, nproc, threads, seconds, barrier, results))
        for rank in range(nproc)
    ]  # fmt: skip
    for p in procs:
        p.start()
    rates: list[float] = []
    try:
        while len(rates) < nproc:
            try:
                rates.append(results.get(timeout=1)[1])
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    codes = [p.exitcode for p in procs]
                    raise RuntimeError(
                        f"a kernel-bound process failed (exit codes {codes})"
                    ) from None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return sum(rates)


def bench_config(nproc: int, threads: int, data_sha: dict[str, str] | None = None,
                 **train: Any) -> dict[str, Any]:  # fmt: skip
    """The default config (``config/config.yaml``), resolved, for ``nproc`` processes of
    ``threads`` threads, with ``train`` overrides (and the data's checksums)."""
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    cfg.pop("scaling", None)
    cfg["run"] = "bench"
    if data_sha:
        cfg["task_args"]["sha256"] = data_sha
    cfg["launch"].update(nproc_per_node=nproc, cpus_per_proc=threads)
    cfg["train"].update(train)
    return config.resolve(cfg, gpus=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--data",
        type=Path,
        default=REPO / "resources" / "mnist",
        help="the task's prepared data (the default: MNIST of `prepare_data`)",
    )
    ap.add_argument("--nproc", type=int, default=2, help="training processes")
    args = ap.parse_args(argv)
    threads = max(1, system.available_cpus() // args.nproc)
    cfg = bench_config(args.nproc, threads)
    bound = measure(cfg, args.data, args.nproc, threads)
    print(f"the default config's step kernels alone, {args.nproc} processes x {threads} "
          f"thread(s): {bound:,.0f} GFLOP/s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
