"""ddppipe's cost per training step against the plainest loops a user would write (issue 59).

Each workload trains the same model, data, optimizer (AdamW, same lr and weight decay),
precision and global batch twice a round: with ddppipe, run as a user runs it locally (the
default DAG, ``snakemake --cores all``, up to the train rule's outputs, no SLURM, no
container), and with a plain loop in this script. Rounds alternate which goes first. The
plain loops:

- 1 rank: the plainest loop: the tensors indexed with a slice of a random permutation,
  forward, loss, backward, ``AdamW.step()``, ``zero_grad()``; no DDP, no sampler, no workers;
- 2 ranks: a plain DDP loop (``torch.multiprocessing``, gloo, every rank the
  ``DistributedSampler``-like strided share of each global batch, bf16 gradient all-reduce
  where the training is bf16, as ddppipe does).

Workloads: ``mlp``: a 16-64-64-5 MLP on Gaussian blobs in a ``TensorDataset``, returned by a
task file written at run time, fp32, batch 256, one epoch of ``--mlp-samples``; ``cnn``: the
seeds' CNN (``ddppipe.tasks.mnist``, recipe ``fast``: its BatchNorm variant, AdamW and the
precision ddppipe decides on these CPUs, bf16 autocast where they multiply bf16 natively), on
the first ``--cnn-samples`` MNIST training images, served from a local mirror. The plain loops
take their recipe (batch, lr, weight decay, label smoothing, channels_last, epochs) from the
config ddppipe resolved and the precision from its evaluation record; their model from the
task's ``model()``, their data from the same files; each rank the CPUs divided by the ranks
as threads, as ddppipe's (``--threads``: that many on both sides).

Figures: samples/s of the steady training (the first ``WARMUP_STEPS`` steps excluded) and ms
a step. The plain loops time their parts directly (data: permutation and indexing;
forward/backward, with DDP's all-reduce; optimizer: step and zero_grad; the loop's own: the
rest of the step). ddppipe's come from what it records (``results/<run>/train/
attempts.json``: ``images_per_s``, ``data_wait_share``, the all-reduce a step exposes): a step
is its data wait plus the rest; the loop's own is estimated as that rest less the plain
loop's forward/backward and optimizer in the same round. Differences from the plain loops that
belong to ddppipe: it binds each rank to its cores, uses fused AdamW (``--fused`` gives the
plain loops that too), steps its schedule (``fast``: one-cycle) and writes its trackers.

    python bench/step_overhead.py                     # mlp and cnn, 1 and 2 ranks, 3 rounds
    python bench/step_overhead.py --workload mlp --ranks 1 --rounds 1
    python bench/step_overhead.py --json figures.json --keep /tmp/so   # also the runs' files
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib.util
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
import yaml

REPO = Path(__file__).resolve().parents[1]
SHARED_MNIST = REPO.parent / "shared" / "data" / "mnist"
WARMUP_STEPS = 10  # per run, as ddppipe's steady figures (ddppipe's efficiency.WARMUP_STEPS)
MEAN, STD = 0.1307, 0.3081  # MNIST's training pixels
MNIST_FILES = {  # name: header bytes, bytes a sample
    "train-images-idx3-ubyte": (16, 784), "train-labels-idx1-ubyte": (8, 1),
    "t10k-images-idx3-ubyte": (16, 784), "t10k-labels-idx1-ubyte": (8, 1),
}  # fmt: skip

# The MLP workload's task, as a user writes one: data prepared once, returned as a TensorDataset.
BLOBS_TASK = '''"""Gaussian blobs (16 features, 5 classes) and a 16-64-64-5 MLP."""

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

FEATURES, CLASSES, HIDDEN = 16, 5, 64


def _blobs(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    centres = torch.randn(CLASSES, FEATURES, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    return centres[y] + torch.randn(n, FEATURES, generator=g), y


def prepare(data_dir: Path, args: dict[str, Any]) -> None:
    data_dir.mkdir(parents=True, exist_ok=True)
    torch.save(_blobs(args["train"], 1), data_dir / "train.pt")
    torch.save(_blobs(args["test"], 2), data_dir / "test.pt")


def datasets(data_dir: Path, args: dict[str, Any]) -> tuple[TensorDataset, TensorDataset]:
    return (TensorDataset(*torch.load(data_dir / "train.pt")),
            TensorDataset(*torch.load(data_dir / "test.pt")))


def model(args: dict[str, Any]) -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN),
                         nn.ReLU(), nn.Linear(HIDDEN, CLASSES))
'''
MLP_RECIPE = {"epochs": 1, "batch_size": 256, "optimizer": "adamw", "lr": 1e-3,
              "weight_decay": 0.01, "schedule": "constant", "precision": "fp32",
              "channels_last": False, "label_smoothing": 0.0}  # fmt: skip


@dataclass
class Figures:
    """One training's steady figures: samples/s and ms a step, split where known."""

    samples_per_s: float
    step_ms: float
    data_ms: float
    parts_ms: dict[str, float]  # the rest of the step, by part (plain) or as a whole (ddppipe)
    load: float  # 1-minute load average at the start
    wall_s: float  # the command's or the processes' wall time


@dataclass
class Pair:
    workload: str
    ranks: int
    round: int
    ours: Figures  # ddppipe's
    plain: Figures

    @property
    def ratio(self) -> float:
        return self.ours.samples_per_s / self.plain.samples_per_s

    @property
    def own_estimate_ms(self) -> float:
        """ddppipe's step less its data wait and the plain loop's forward/backward and
        optimizer: the loop's own work, estimated."""
        rest = self.ours.step_ms - self.ours.data_ms
        return rest - self.plain.parts_ms["fwd_bwd"] - self.plain.parts_ms["optim"]


# -- data ----------------------------------------------------------------------------------
def mnist_subset(mirror: Path, work: Path, train: int, test: int) -> tuple[Path, Path, dict]:
    """The first ``train`` and ``test`` MNIST samples of ``mirror``: a mirror folder of their
    ``.gz`` files, the decompressed files (the plain loops read them) and their SHA-256s."""
    served, plain = work / "mnist-mirror", work / "mnist-idx"
    served.mkdir(parents=True, exist_ok=True)
    plain.mkdir(parents=True, exist_ok=True)
    sums = {}
    for name, (header, size) in MNIST_FILES.items():
        n = train if name.startswith("train") else test
        raw = gzip.decompress((mirror / f"{name}.gz").read_bytes())
        data = raw[:4] + n.to_bytes(4, "big") + raw[8:header] + raw[header : header + n * size]
        (plain / name).write_bytes(data)
        (served / f"{name}.gz").write_bytes(gzip.compress(data, compresslevel=1))
        sums[name] = hashlib.sha256(data).hexdigest()
    return served, plain, sums


# -- ddppipe -------------------------------------------------------------------------------
def run_ddppipe(work: Path, run: str, overrides: dict[str, Any]) -> tuple[Figures, dict]:
    """Train ``run`` with the DAG as a user does (``snakemake --cores all``), up to the train
    rule's outputs; its steady figures, and its resolved recipe for the plain loop."""
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    cfg.pop("scaling", None)
    for key, value in overrides.items():
        cfg[key] = {**cfg[key], **value} if isinstance(value, dict) and key != "task_args" \
            else value  # fmt: skip
    cfg["run"] = run
    config = work / f"{run}.yaml"
    config.write_text(yaml.safe_dump(cfg))
    bindir = str(Path(sys.executable).parent)
    load, started = os.getloadavg()[0], time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(work),
         "--configfile", str(config), "--cores", "all", f"results/{run}/train/metrics.jsonl"],
        cwd=work, capture_output=True, text=True, check=False,
        env={**os.environ, "PATH": f"{bindir}:{os.environ.get('PATH', '/usr/bin:/bin')}"},
    )  # fmt: skip
    wall = time.monotonic() - started
    (work / f"{run}.log").write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        raise RuntimeError(f"ddppipe run {run} failed; see {work / run}.log:\n"
                           + result.stderr[-3000:])  # fmt: skip
    train = work / "results" / run / "train"
    efficiency = json.loads((train / "attempts.json").read_text())[-1]["efficiency"]
    resolved = yaml.safe_load((work / "results" / run / "config.yaml").read_text())
    recipe = {
        **resolved["train"],
        "task_args": resolved["task_args"],
        "precision": json.loads((train / "evaluation.json").read_text())["precision"],
    }
    step_ms = 1e3 * recipe["batch_size"] / efficiency["images_per_s"]
    parts = {"rest": step_ms * (1 - efficiency.get("data_wait_share", 0.0))}
    if "communication_s" in efficiency:  # the all-reduce a step exposes (2 ranks)
        parts["allreduce_exposed"] = 1e3 * efficiency["communication_s"]
    return Figures(efficiency["images_per_s"], step_ms, step_ms - parts["rest"], parts, load,
                   wall), recipe  # fmt: skip


# -- the plain loops -----------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_task_file(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location("blobs_task", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def plain_data(spec: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.nn.Module]:
    """The training tensors and the model, from the same files and task as ddppipe's run."""
    args = spec["task_args"]
    if spec["workload"] == "mlp":
        task = load_task_file(Path(spec["task_file"]))
        train, _ = task.datasets(Path(spec["data"]), args)
        x, y = train.tensors
    else:
        from ddppipe.tasks import mnist  # the task's model(), as ddppipe builds it

        task = mnist
        folder = Path(spec["data"])
        images = (folder / "train-images-idx3-ubyte").read_bytes()[16:]
        labels = (folder / "train-labels-idx1-ubyte").read_bytes()[8:]
        x = torch.frombuffer(bytearray(images), dtype=torch.uint8).view(-1, 1, 28, 28)
        x = (x.float() / 255 - MEAN) / STD
        y = torch.frombuffer(bytearray(labels), dtype=torch.uint8).long()
    torch.manual_seed(spec["seed"])
    return x, y, task.model(args)


def plain_rank(rank: int, spec: dict[str, Any], out: str) -> None:
    """One rank of the plain loop; rank 0 writes its steady figures to ``out``."""
    torch.set_num_threads(spec["threads"])
    world = spec["ranks"]
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['port']}",
                                rank=rank, world_size=world)  # fmt: skip
    x_all, y_all, model = plain_data(spec)
    bf16 = spec["precision"] == "bfloat16"
    fmt = torch.channels_last if spec["channels_last"] else torch.contiguous_format
    model = model.to(memory_format=fmt)
    net = model
    if world > 1:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel as DDP

        net = DDP(model)
        if bf16:
            net.register_comm_hook(None, default_hooks.bf16_compress_hook)
    opt = torch.optim.AdamW(net.parameters(), lr=spec["lr"], weight_decay=spec["weight_decay"],
                            fused=True if spec["fused"] else None)  # fmt: skip
    n, batch = len(y_all), spec["batch_size"]
    steps = n // batch  # (the sizes are whole batches: no tail batch on either side)
    g = torch.Generator().manual_seed(spec["seed"])
    timed = {"data": 0.0, "fwd_bwd": 0.0, "optim": 0.0}
    perm = torch.empty(0, dtype=torch.long)
    if world > 1:
        dist.barrier()
    began = time.perf_counter()
    for step in range(spec["epochs"] * steps):
        if step == WARMUP_STEPS:
            timed = dict.fromkeys(timed, 0.0)
            began = time.perf_counter()
        t0 = time.perf_counter()
        k = step % steps
        if k == 0:
            perm = torch.randperm(n, generator=g)
        idx = perm[k * batch : (k + 1) * batch][rank::world]
        x, y = x_all[idx].contiguous(memory_format=fmt), y_all[idx]
        t1 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            output = net(x)
        loss = F.cross_entropy(output.float(), y, label_smoothing=spec["label_smoothing"])
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t3 = time.perf_counter()
        timed["data"] += t1 - t0
        timed["fwd_bwd"] += t2 - t1
        timed["optim"] += t3 - t2
    seconds = time.perf_counter() - began
    if rank == 0:
        steady = spec["epochs"] * steps - WARMUP_STEPS
        Path(out).write_text(json.dumps({"steps": steady, "seconds": seconds, **timed,
                                         "last_loss": float(loss.detach())}))  # fmt: skip
    if world > 1:
        dist.destroy_process_group()


def run_plain(spec: dict[str, Any], work: Path, name: str) -> Figures:
    """The plain loop on ``spec['ranks']`` fresh processes; rank 0's steady figures."""
    out = work / f"{name}.plain.json"
    spec = {**spec, "port": free_port()}
    load, started = os.getloadavg()[0], time.monotonic()
    mp.start_processes(plain_rank, args=(spec, str(out)), nprocs=spec["ranks"],
                       start_method="spawn")  # fmt: skip
    wall = time.monotonic() - started
    got = json.loads(out.read_text())
    step_ms = 1e3 * got["seconds"] / got["steps"]
    parts = {key: 1e3 * got[key] / got["steps"] for key in ("fwd_bwd", "optim")}
    data_ms = 1e3 * got["data"] / got["steps"]
    parts["own"] = step_ms - data_ms - parts["fwd_bwd"] - parts["optim"]
    return Figures(spec["batch_size"] * got["steps"] / got["seconds"], step_ms, data_ms, parts,
                   load, wall)  # fmt: skip


# -- the workloads -------------------------------------------------------------------------
def workload_setup(name: str, args: argparse.Namespace, work: Path) -> tuple[dict, dict]:
    """(ddppipe's config overrides, the plain loops' data) of workload ``name``."""
    if name == "mlp":
        task_file = work / "blobs.py"
        task_file.write_text(BLOBS_TASK)
        task_args = {"train": args.mlp_samples, "test": 10_000}
        data = work / "plain-blobs"
        load_task_file(task_file).prepare(data, task_args)  # the task's prepare(), again
        overrides = {"task": str(task_file), "task_args": task_args, "train": MLP_RECIPE}
        return overrides, {"task_file": str(task_file), "data": str(data)}
    served, plain, sums = mnist_subset(args.mirror, work, args.cnn_samples, 2_000)
    overrides = {"task_args": {"mirrors": [served.as_uri() + "/"], "sha256": sums},
                 "train": {"preset": "fast"}}  # fmt: skip
    return overrides, {"data": str(plain)}


def plain_spec(workload: str, ranks: int, recipe: dict, data: dict, fused: bool,
               threads: int | None) -> dict:  # fmt: skip
    keys = ("batch_size", "lr", "weight_decay", "label_smoothing", "channels_last", "epochs",
            "seed", "precision", "task_args")  # fmt: skip
    threads = threads or max(1, len(os.sched_getaffinity(0)) // ranks)  # (ddppipe's default)
    return {"workload": workload, "ranks": ranks, "fused": fused, "threads": threads, **data,
            **{key: recipe[key] for key in keys}}  # fmt: skip


def measure(args: argparse.Namespace, work: Path) -> list[Pair]:
    pairs = []
    for workload in args.workload:
        overrides, data = workload_setup(workload, args, work)
        for ranks in args.ranks:
            launch = {"launch": {"nproc_per_node": ranks, "cpus_per_proc": args.threads}}
            recipe: dict | None = None
            for r in range(1, args.rounds + 1):
                run = f"{workload}-{ranks}r-{r}"
                print(f"round {r}: {workload} at {ranks} rank(s) ...", file=sys.stderr, flush=True)
                plain = None
                if r % 2 == 0 and recipe is not None:  # even rounds: the plain loop first
                    plain = run_plain(plain_spec(workload, ranks, recipe, data, args.fused,
                                                 args.threads),
                                      work, run)  # fmt: skip
                ours, recipe = run_ddppipe(work, run, {**overrides, **launch})
                if plain is None:
                    plain = run_plain(plain_spec(workload, ranks, recipe, data, args.fused,
                                                 args.threads),
                                      work, run)  # fmt: skip
                pairs.append(Pair(workload, ranks, r, ours, plain))
    return pairs


# -- report --------------------------------------------------------------------------------
def header(began: str) -> str:
    flags = set()
    model = platform.processor() or platform.machine()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    for line in lscpu.splitlines():
        if line.strip().startswith("Model name"):
            model = line.split(":", 1)[1].strip()
    commit = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty",
                             "--abbrev=12"], capture_output=True, text=True,
                            check=False).stdout.strip()  # fmt: skip
    has = ", ".join(f"{flag} {'yes' if flag in flags else 'no'}"
                    for flag in ("avx512_bf16", "amx_bf16"))  # fmt: skip
    return (f"step overhead, {began}-{time.strftime('%H:%M %Z')}, {platform.node()}: {model} "
            f"({has}), {len(os.sched_getaffinity(0))} CPUs, torch {torch.__version__}, "
            f"commit {commit}")  # fmt: skip


def table(pairs: list[Pair]) -> str:
    lines = [
        "| workload | ranks | round | samples/s ddppipe | samples/s plain | ratio | "
        "ddppipe ms/step = data + rest | of the rest, loop's own (est.) | "
        "plain ms/step = data + fwd/bwd + optim + own | load |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in pairs:
        d, q = p.ours, p.plain
        comm = d.parts_ms.get("allreduce_exposed")
        rest = f"{d.parts_ms['rest']:.2f}" + (f" (all-reduce {comm:.2f})" if comm else "")
        lines.append(
            f"| {p.workload} | {p.ranks} | {p.round} | {d.samples_per_s:,.0f} | "
            f"{q.samples_per_s:,.0f} | {p.ratio:.2f}x | {d.step_ms:.2f} = {d.data_ms:.2f} + "
            f"{rest} | {p.own_estimate_ms:.2f} | {q.step_ms:.2f} = {q.data_ms:.2f} + "
            f"{q.parts_ms['fwd_bwd']:.2f} + {q.parts_ms['optim']:.2f} + {q.parts_ms['own']:.2f}"
            f" | {d.load:.1f}/{q.load:.1f} |"
        )
    return "\n".join(lines)


def summary(pairs: list[Pair]) -> str:
    lines = []
    for key in dict.fromkeys((p.workload, p.ranks) for p in pairs):
        ratios = [p.ratio for p in pairs if (p.workload, p.ranks) == key]
        lines.append(f"{key[0]} at {key[1]} rank(s): ddppipe at {statistics.median(ratios):.2f}x "
                     f"the plain loop (median of {len(ratios)}; {min(ratios):.2f}-"
                     f"{max(ratios):.2f}x)")  # fmt: skip
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=("mlp", "cnn"), action="append",
                    help="repeatable; default both")  # fmt: skip
    ap.add_argument("--ranks", type=int, choices=(1, 2), action="append",
                    help="repeatable; default 1 and 2")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mlp-samples", type=int, default=256_000,
                    help="the MLP's training samples (a multiple of 256): one epoch")  # fmt: skip
    ap.add_argument("--cnn-samples", type=int, default=12_800,
                    help="MNIST training images the CNN trains on (a multiple of 128)")  # fmt: skip
    ap.add_argument("--mirror", type=Path, default=SHARED_MNIST,
                    help="folder of MNIST's *.gz files")  # fmt: skip
    ap.add_argument("--fused", action="store_true", help="the plain loops' AdamW fused")
    ap.add_argument("--threads", type=int,
                    help="CPU threads a rank, both sides (ddppipe's launch.cpus_per_proc); "
                         "default: the CPUs shared out, as ddppipe's default")  # fmt: skip
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument("--keep", type=Path, help="run in this folder and keep it")
    args = ap.parse_args(argv)
    args.workload = args.workload or ["mlp", "cnn"]
    args.ranks = args.ranks or [1, 2]
    if args.mlp_samples % 256 or args.cnn_samples % 128:
        ap.error("--mlp-samples must be a multiple of 256, --cnn-samples of 128")
    if min(args.mlp_samples // 256, args.cnn_samples // 128) < 2 * WARMUP_STEPS:
        ap.error(f"too few samples: at least {2 * WARMUP_STEPS} steps, half of them steady")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ddppipe-step-overhead-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        started, began = time.monotonic(), time.strftime("%Y-%m-%d %H:%M")
        pairs = measure(args, work.resolve())
    print(header(began))
    print(f"load average (1 min) at the end {os.getloadavg()[0]:.1f}; the whole run "
          f"{(time.monotonic() - started) / 60:.1f} min; ms a step of the steady training; "
          f"plain AdamW {'fused' if args.fused else 'default (for-loop on CPU)'}; threads a "
          f"rank {args.threads or 'the CPUs shared out'}\n")  # fmt: skip
    print(table(pairs))
    print()
    print(summary(pairs))
    if args.json:
        args.json.write_text(json.dumps([asdict(p) | {"ratio": p.ratio} for p in pairs],
                                        indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
