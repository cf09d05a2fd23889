"""MNIST as 70,000 PNG files streamed from shards (``ddppipe.data.shards``), and its exact-once
guarantee across world sizes and DataLoader worker counts.

Writes MNIST as PNG files (``train/<class>/``, ``test/<class>/``: bench/data_folder.py's
writer), then with a task written here (the images' PNG bytes, class and index in shards of
``examples/tasks/imageshards.py``'s layout; the example's CNN, grey 28x28, the fast
recipe):

- ``ddppipe prepare`` of the shards;
- one epoch of 2 ranks of ``ddppipe launch``, the default DataLoader workers: images/s, the
  data-wait share, the files opened under the data folder (``strace -f -e trace=openat``, a
  run of its own), against the same images decoded and held as tensors (``imagefolder``'s
  pack, bench/data_folder.py's tensors task with this CNN);
- one epoch stopped (SIGUSR1) at 2 ranks of 2 workers, continued at 1 rank of 4 workers,
  stopped again and finished at 3 ranks: how many samples each slot trained, how many were
  trained twice or never (the ids of each rank's optimizer steps), and the largest
  difference of the final weights from uninterrupted runs of 1, 2 and 3 ranks (and of those
  from each other: fp32 sums in another order, amplified by AdamW).

    python bench/shards.py            # ../shared/data/mnist; ~15 minutes here
    python bench/shards.py --quick    # 3,000 images, no strace run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import data_folder as folder_bench  # bench/data_folder.py: the folder writer, the runs

REPO = Path(__file__).resolve().parents[1]

# The tensors comparison's task: bench/data_folder.py's (imagefolder's pack held as tensors),
# with the shards task's CNN, so that both train the same model.
TENSORS_TASK = (
    folder_bench.TENSORS_TASK
    + """
import importlib.util

spec = importlib.util.spec_from_file_location("shards_task", Path(__file__).with_name(
    "shards_task.py"))
shards_task = importlib.util.module_from_spec(spec)
spec.loader.exec_module(shards_task)


def model(args):  # (this definition wins: the shards task's CNN)
    return shards_task.cnn(args)
"""
)

# Shards of the PNG files with each sample's index; the example task's CNN (no batch norm,
# no dropout: the same numbers at any world size); each optimizer step logs the indices of
# the batch its rank trained (IDS_DIR) and rank 0 stops itself at its STOP_AT_FORWARD-th
# training forward (SIGUSR1, as before a time limit).
SHARDS_TASK = """
import io, os, random, signal
from pathlib import Path

import torch
import torch.nn.functional as F
from PIL import Image

from ddppipe import tasks
from ddppipe.data import shards
from ddppipe.tasks import imagefolder
from torch.optim.optimizer import register_optimizer_step_post_hook

ARGS_SCHEMA = imagefolder.ARGS_SCHEMA


def cnn(args):  # examples/tasks/imageshards.py's
    w = args["width"]
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, w, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(w, 2 * w, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(2 * w * 7 * 7, 10))


def prepare(data_dir, args):
    names = imagefolder.classes(args)
    for split in ("train", "test"):
        files = [(p, c) for c, n in enumerate(names)
                 for p in sorted((Path(args["root"]) / split / n).glob("*.png"))]
        random.Random(0).shuffle(files)
        with shards.Writer(data_dir / split, 64 << 20) as w:
            for i, (p, c) in enumerate(files):
                w.write({"img": p.read_bytes(), "cls": str(c).encode(), "id": str(i).encode()})


def decode(sample):
    image = Image.open(io.BytesIO(sample["img"])).convert("L")
    x = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(1, 28, 28)
    return x.float() / 127.5 - 1.0, int(sample["cls"]) + 10 * int(sample["id"])


def datasets(data_dir, args):
    return shards.Sharded(data_dir / "train", decode), shards.Sharded(data_dir / "test", decode)


def model(args):
    net, forwards = cnn(args), [0]

    def stop_at(module, inputs):
        if module.training and torch.is_grad_enabled() and os.environ["RANK"] == "0":
            forwards[0] += 1
            if forwards[0] == int(os.environ.get("STOP_AT_FORWARD", "0")):
                os.kill(os.getpid(), signal.SIGUSR1)

    net.register_forward_pre_hook(stop_at)
    return net


LAST = []  # the ids of the batch the last loss saw


def trained(optimizer, args, kwargs):  # after each optimizer step: a trained batch
    grads = [p.grad for g in optimizer.param_groups for p in g["params"]]
    if not any(g is not None and bool(g.any()) for g in grads):
        return  # DCP's step with zero gradients, before it loads the optimizer's state
    if os.environ.get("IDS_DIR") and LAST:
        with open(Path(os.environ["IDS_DIR"]) / f"ids-{os.getpid()}.txt", "a") as f:
            f.write(" ".join(map(str, LAST[-1])) + "\\n")


register_optimizer_step_post_hook(trained)


def loss(output, target):
    LAST[:] = [(target // 10).tolist()]  # (the probes' forwards too: they take no step)
    return F.cross_entropy(output, target % 10)


def metrics(output, target):
    return {"loss": F.cross_entropy(output.float(), target % 10, reduction="sum"),
             "accuracy": (output.argmax(1) == target % 10).sum()}
"""


def slot(work: Path, name: str, nproc: int, workers: int | None, **env: str) -> dict[str, Any]:
    """One slot of the run ``name`` (1 epoch, SGD: see :func:`exactly_once`); its last
    attempt record."""
    from ddppipe.launching import resolve

    cfg = folder_bench.yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    cfg.update(
        run=name,
        task=str(work / "shards_task.py"),
        task_args=folder_bench.TASK_ARGS | {"root": str(work / "images")},
    )
    cfg["train"].update(epochs=1, batch_size=240, eval_batch_size=1000, precision="fp32",
                        optimizer="sgd", lr=0.05)  # fmt: skip
    cfg["launch"].update(nproc_per_node=nproc, loader_workers=workers)
    run = work / "runs" / name
    resolve.write_resolved(cfg, run / "config.yaml", gpus=False)
    (run / "ids").mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "ddppipe",
        "launch",
        f"--config={run / 'config.yaml'}",
        f"--data={work / 'shards'}",
        f"--state={run / 'state'}",
        f"--checkpoint={run / 'final.pt'}",
        f"--metrics={run / 'metrics.jsonl'}",
    ]
    subprocess.run(
        command,
        cwd=work,
        env={**os.environ, "IDS_DIR": str(run / "ids"), **env},
        capture_output=True,
        check=False,
    )
    return json.loads((run / "state" / "attempts.json").read_text())[-1]


def exactly_once(work: Path) -> dict[str, Any]:
    """2 ranks of 2 workers, 1 of 4, 3 of the default: each sample's count, the weights.

    SGD with momentum, not the fast recipe's AdamW: the ranks' gradients are summed in fp32 in
    another order at another world size, and AdamW's division by the gradients' root mean
    square turns those last-bit differences of tiny gradients into steps of the learning rate
    (the AdamW runs of 1 and 2 ranks, uninterrupted, ended 0.056 apart here); SGD keeps them
    at their size, so the weights say whether the data was the same."""
    import torch

    listing = json.loads((work / "shards" / "train.shards.json").read_text())
    samples = sum(s["count"] for s in listing["shards"])
    third = str(-(-samples // 240) // 3)  # a third of the epoch's steps (global batch 240)
    slots = [
        slot(work, "stopped", 2, 2, STOP_AT_FORWARD=third),
        slot(work, "stopped", 1, 4, STOP_AT_FORWARD=third),
        slot(work, "stopped", 3, None),
    ]
    for nproc in (1, 2, 3):  # uninterrupted, at each world size the run trained at
        slot(work, f"straight-{nproc}", nproc, None)
    ids = Counter(
        int(i) for f in (work / "runs" / "stopped" / "ids").iterdir() for i in f.read_text().split()
    )
    weights = {
        r: torch.load(work / "runs" / r / "model.pt", weights_only=True)
        for r in ("stopped", "straight-1", "straight-2", "straight-3")
    }

    def apart(a: str, b: str) -> float:
        return max((weights[a][k] - weights[b][k]).abs().max().item() for k in weights[a])

    return {
        "slots": [
            {k: s[k] for k in ("world_size", "start_step", "end_step", "outcome")} for s in slots
        ],
        "samples_trained_once": sum(c == 1 for c in ids.values()),
        "samples_trained_twice_or_more": sum(c > 1 for c in ids.values()),
        "samples_never_trained": samples - len(ids),
        "max_weight_difference": {
            f"stopped vs uninterrupted at {n}": apart("stopped", f"straight-{n}") for n in (1, 2, 3)
        }
        | {"uninterrupted at 1 vs at 2": apart("straight-1", "straight-2")},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mirror", type=Path, default=folder_bench.SHARED_MNIST)
    ap.add_argument("--quick", action="store_true", help="3,000 images, no strace run")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="ddppipe-shards-bench-"))
    try:
        count = folder_bench.write_mnist_folder(
            args.mirror, work / "images", 3000 if args.quick else None
        )
        (work / "shards_task.py").write_text(SHARDS_TASK)
        (work / "tensors_task.py").write_text(TENSORS_TASK)
        targs = {"root": str(work / "images"), **folder_bench.TASK_ARGS}
        started = time.perf_counter()
        folder_bench.prepare(work, "shards", str(work / "shards_task.py"), targs)
        figures: dict[str, Any] = {
            "images": count,
            "prepare_s": round(time.perf_counter() - started, 1),
            "shards": len(list((work / "shards").glob("*.tar"))),
        }
        folder_bench.prepare(work, "packed", "ddppipe.tasks.imagefolder", {**targs, "pack": True})
        task = str(work / "shards_task.py")
        figures["epoch"] = {
            "shards": folder_bench.train(work, "shards", task, targs, "shards"),
            "tensors": folder_bench.train(
                work, "tensors", str(work / "tensors_task.py"), {**targs, "pack": True}, "packed"
            ),
        }
        if not args.quick:  # the files opened during the epoch (a traced run)
            traced = folder_bench.train(work, "shards", task, targs, "shards", trace=True)
            figures["epoch"]["shards"]["opened_under_data"] = traced["opened_under_data"]
        figures["exactly_once"] = exactly_once(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    figures.update(folder_bench.measured_on())
    print(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
