"""A folder of many image files: loose against packed against tensors, and prepare at scale.

Writes MNIST as 70,000 PNG files (``train/<class>/`` and ``test/<class>/``, from the IDX
files of ``--mirror``), then measures with the built-in ``imagefolder`` task (grey, 28x28,
its CNN, the fast recipe, 2 ranks of ``ddppipe launch``, the default DataLoader workers):

- ``ddppipe prepare`` of the loose folder, of its pack (``pack: true``) and of its SquashFS
  image (``data.pack: squashfs``: the PNG files as they are, in one image), and the packed
  prepare again after 10 images changed;
- one epoch's images/s and its data-wait share (the attempt record's ``data_wait_share``)
  from the loose files, from the pack (with the default workers and with none), from the
  SquashFS image (mounted by each rank with squashfuse, else unpacked), from that image staged
  to a node folder (``launch.stage_data``), and from the same decoded images held as tensors
  by a task written here (the same CNN and normalisation: the in-memory path of
  ``ddppipe.data``); the pack and the tensors in ``--rounds`` interleaved rounds (medians);
- the files opened under the image folder, under the data folder and through the image's
  mount during that epoch (``strace -f -e trace=openat``, a run of its own: tracing slows it).

``--files N`` instead generates a folder of N small PNG files (100 classes) and times the
packless prepare, and again after 10 files changed (the stat cache's case).

    python bench/data_folder.py                        # ../shared/data/mnist; ~10 minutes here
    python bench/data_folder.py --files 1000000        # prepare at scale; ~20 minutes here
    python bench/data_folder.py --quick                # 3,000 images: a smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
SHARED_MNIST = REPO.parent / "shared" / "data" / "mnist"
TASK_ARGS = {"image_size": 28, "channels": 1, "width": 32}

# The comparison's in-memory task: the pack's decoded images as tensors, the same CNN.
TENSORS_TASK = '''
"""The imagefolder task's pack held as tensors (bench/data_folder.py's comparison)."""
from pathlib import Path

import numpy as np
import torch

from ddppipe.data import Tensors
from ddppipe.tasks import imagefolder

ARGS_SCHEMA = imagefolder.ARGS_SCHEMA


def prepare(data_dir, args):
    imagefolder.prepare(data_dir, args)


def datasets(data_dir, args):
    def part(split):
        pixels = torch.from_numpy(np.load(Path(data_dir) / f"{split}.npy"))
        labels = torch.from_numpy(np.load(Path(data_dir) / f"{split}.labels.npy"))
        return Tensors(pixels, labels, imagefolder._normalize)

    return part("train"), part("test")


def model(args):
    return imagefolder.model(args)
'''


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mirror", type=Path, default=SHARED_MNIST, help="folder of the *.gz files")
    ap.add_argument("--quick", action="store_true", help="3,000 images")
    ap.add_argument("--files", type=int, help="time prepare on N generated small files")
    ap.add_argument("--keep", type=Path, help="work in this folder and keep it")
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="interleaved rounds of the packed and tensors epochs (medians kept)",
    )
    return ap.parse_args(argv)


def ddppipe(*args: str, cwd: Path, trace: Path | None = None) -> float:
    """Run ``python -m ddppipe ARGS``; its wall time (raise with its output on failure)."""
    command = [sys.executable, "-m", "ddppipe", *args]
    if trace is not None:
        command = ["strace", "-f", "-qq", "-e", "trace=openat", "-o", str(trace), *command]
    started = time.perf_counter()
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"ddppipe {args[0]} failed:\n{result.stderr[-4000:]}")
    return time.perf_counter() - started


def write_mnist_folder(mirror: Path, root: Path, limit: int | None) -> int:
    """MNIST's images as PNG files under root/{train,test}/<digit>/; how many (``limit``: at
    most that many, five sixths of them training images)."""
    import gzip

    from PIL import Image

    from ddppipe.data import mnist_files

    idx = root.parent / "mnist"
    idx.mkdir(parents=True, exist_ok=True)
    for name in mnist_files.FILES:
        (idx / name).write_bytes(gzip.decompress((mirror / f"{name}.gz").read_bytes()))
    mnist = mnist_files.load(idx)
    count = 0
    for split, part in (("train", mnist.train), ("test", mnist.test)):
        n = len(part.labels) if limit is None else limit * (5 if split == "train" else 1) // 6
        for i in range(n):
            folder = root / split / str(int(part.labels[i]))
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(part.images[i].numpy()).save(folder / f"{i:05d}.png")
        count += n
    return count


def write_small_files(root: Path, n: int) -> None:
    """``n`` 8x8 grey PNG files in 100 class folders (a few bytes each, all distinct)."""
    import io

    from PIL import Image

    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    Image.fromarray(np.zeros((8, 8), np.uint8)).save(buf, format="PNG")
    for c in range(100):
        (root / f"c{c:02d}").mkdir(parents=True, exist_ok=True)
    for i in range(n):
        pixels = rng.integers(0, 256, (8, 8), dtype=np.uint8)
        buf.seek(0)
        buf.truncate()
        Image.fromarray(pixels).save(buf, format="PNG")
        (root / f"c{i % 100:02d}" / f"{i:07d}.png").write_bytes(buf.getvalue())


def change(files: list[Path]) -> None:
    """Write other pixels into each of ``files``."""
    from PIL import Image

    for k, path in enumerate(files):
        with Image.open(path) as image:
            pixels = np.array(image)
        Image.fromarray((pixels + 1 + k).astype(np.uint8)).save(path)


def prepare(work: Path, name: str, task: str, args: dict[str, Any],
            data: dict[str, Any] | None = None) -> float:  # fmt: skip
    settings = work / f"{name}.yaml"
    packed = {"data": data} if data else {}
    settings.write_text(yaml.safe_dump({"task": task, "task_args": args, **packed}))
    return ddppipe("prepare", f"--settings={settings}", f"--dest={work / name}", cwd=work)


def train(work: Path, name: str, task: str, args: dict[str, Any], data: str, trace: bool = False,
          settings: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """One epoch of 2 ranks on data folder ``data``; its metrics and (traced) opened files.
    ``settings``: more of the config's sections (``data``, ``launch``)."""
    from ddppipe.launching import resolve

    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    cfg.update(run=name, task=task, task_args=args)
    cfg["train"].update(epochs=1, eval_batch_size=1000)
    for section, values in (settings or {}).items():
        cfg[section] = {**(cfg.get(section) or {}), **values}
    run = work / "runs" / (name + ("-traced" if trace else ""))
    shutil.rmtree(run, ignore_errors=True)
    resolve.write_resolved(cfg, run / "config.yaml", gpus=False)
    strace = run / "openat.txt" if trace else None
    wall = ddppipe("launch", f"--config={run / 'config.yaml'}", f"--data={work / data}",
                   f"--state={run / 'state'}", f"--checkpoint={run / 'final.pt'}",
                   f"--metrics={run / 'metrics.jsonl'}", cwd=work, trace=strace)  # fmt: skip
    (metrics,) = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    attempts = json.loads((run / "state" / "attempts.json").read_text())
    out = {"wall_s": round(wall, 1), "images_per_s": metrics["images_per_s"],
           "test_accuracy": metrics["test_accuracy"],
           "data_wait_share": attempts[-1]["efficiency"].get("data_wait_share"),
           "stage_s": attempts[-1]["efficiency"].get("stage_s")}  # fmt: skip
    if strace:
        opened = re.findall(r'openat\([^"]*"([^"]+)"', strace.read_text())
        out["opened_under_images"] = sum(p.startswith(str(work / "images")) for p in opened)
        out["opened_under_data"] = sum(p.startswith(str(work / data) + "/") for p in opened)
        out["opened_through_mount"] = sum(f"/ddppipe-{os.getuid()}/sqfs-" in p for p in opened)
    return out


def packed_against_tensors(work: Path, task: str, packed: dict[str, Any], tensors: str,
                           rounds: int) -> dict[str, Any]:  # fmt: skip
    """The pack (the default workers, and none: read in the training thread) against the same
    images as tensors, in ``rounds`` interleaved rounds: one epoch's rate varies by a few
    percent from run to run on two cores, so each form keeps the median of its rates (the other
    figures: of its middle run, the lower one of an even count), every round's rate beside it."""
    forms = {
        "tensors": lambda: train(work, "tensors", tensors, packed, "packed"),
        "packed": lambda: train(work, "packed", task, packed, "packed"),
        "packed_no_workers": lambda: train(work, "packed-no-workers", task, packed, "packed",
                                           settings={"launch": {"loader_workers": 0}}),
    }  # fmt: skip
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in forms}
    for _ in range(rounds):
        for name, run in forms.items():
            runs[name].append(run())
    medians = {}
    for name, each in runs.items():
        rates = [r["images_per_s"] for r in each]
        middle = sorted(each, key=lambda r: r["images_per_s"])[(len(each) - 1) // 2]
        medians[name] = {**middle, "images_per_s": statistics.median(rates),
                         "images_per_s_rounds": [round(x, 1) for x in rates]}  # fmt: skip
    for name in ("packed", "packed_no_workers"):
        ratio = medians[name]["images_per_s"] / medians["tensors"]["images_per_s"]
        medians[name]["against_tensors"] = round(ratio, 3)
    return medians


def folder_figures(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    started = time.perf_counter()
    count = write_mnist_folder(args.mirror, work / "images", 3000 if args.quick else None)
    written = round(time.perf_counter() - started, 1)
    figures: dict[str, Any] = {"images": count, "write_folder_s": written}
    task = "ddppipe.tasks.imagefolder"
    loose = {"root": str(work / "images"), **TASK_ARGS}
    packed = {**loose, "pack": True}
    figures["prepare_loose_s"] = round(prepare(work, "loose", task, loose), 1)
    figures["prepare_packed_s"] = round(prepare(work, "packed", task, packed), 1)
    squashfs = {"data": {"pack": "squashfs"}}
    figures["prepare_squashfs_s"] = round(prepare(work, "squashfs", task, loose, **squashfs), 1)
    image = next((work / "squashfs").glob("*.sqfs"))
    figures["squashfs_image_mb"] = round(image.stat().st_size / 1e6, 1)
    staged = {**squashfs, "launch": {"stage_data": str(work / "node-local")}}
    change(sorted((work / "images" / "train" / "3").glob("*.png"))[:10])
    figures["prepare_packed_10_changed_s"] = round(prepare(work, "packed", task, packed), 1)
    (work / "tensors_task.py").write_text(TENSORS_TASK)
    tensors = str(work / "tensors_task.py")
    figures["epoch"] = {
        "loose": train(work, "loose", task, loose, "loose"),
        **packed_against_tensors(work, task, packed, tensors, 1 if args.quick else args.rounds),
        "squashfs": train(work, "squashfs", task, loose, "squashfs", settings=squashfs),
        "squashfs_staged": train(
            work, "squashfs_staged", task, loose, "squashfs", settings=staged
        ),  # (copied by this run: its stage_s)
    }
    # The files each way opens during the epoch (a traced run each).
    for name, targs, data, more in (("loose", loose, "loose", None),
                                    ("packed", packed, "packed", None),
                                    ("squashfs", loose, "squashfs", squashfs)):  # fmt: skip
        if name == "squashfs" or not args.quick:
            traced = train(work, name, task, targs, data, trace=True, settings=more)
            figures["epoch"][name].update(
                {k: v for k, v in traced.items() if k.startswith("opened")}
            )
    return figures


def files_figures(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    started = time.perf_counter()
    write_small_files(work / "files", args.files)
    written = round(time.perf_counter() - started, 1)
    figures: dict[str, Any] = {"files": args.files, "write_files_s": written}
    targs = {"root": str(work / "files")}
    task = "ddppipe.tasks.imagefolder"
    figures["prepare_s"] = round(prepare(work, "data", task, targs), 1)
    change(sorted((work / "files" / "c07").iterdir())[:10])
    figures["prepare_10_changed_s"] = round(prepare(work, "data", task, targs), 1)
    return figures


def measured_on() -> dict[str, str]:
    """When (UTC) and on what CPU the figures were measured."""
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = re.search(r"Model name:\s*(.*)", lscpu)
    return {
        "when": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{model[1] if model else platform.processor()}, {os.cpu_count()} CPUs",
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = args.keep or Path(tempfile.mkdtemp(prefix="ddppipe-data-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        measured = files_figures(args, work) if args.files else folder_figures(args, work)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    measured.update(**measured_on(), quick=args.quick)
    print(json.dumps(measured, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
