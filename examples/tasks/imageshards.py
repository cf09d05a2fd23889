"""imageshards: an example task file whose data is streamed from shards (``ddppipe.data.shards``).

For a folder of images too many or too large to read file by file each epoch, or to hold in
memory: ``prepare`` copies each image's bytes, undecoded, with its class into shards of
``shard_mb`` MB in the data folder (plain tar files: a few hundred files on the shared
filesystem instead of one per image), once; training streams them, each rank's DataLoader
workers reading their samples shard by shard in file order and decoding them there.

``task_args.root`` holds ``train/<class>/*`` and ``test/<class>/*`` (PNG, JPEG, anything
PIL reads); the classes are the folder names, sorted. ``image_size`` (28) and ``channels``
(1) are what the images are resized and converted to; ``window`` (8192) is the shuffle
buffer: an epoch shuffles the shards, then the samples within each ``window`` consecutive
ones. Run it with::

    snakemake --cores all --config task=examples/tasks/imageshards.py run=shards \\
        'task_args={root: /project/mygroup/images}'
"""

from __future__ import annotations

import io
import random
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch import nn

from ddppipe.data import shards

SPLITS = ("train", "test")
ARGS_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["root"],
    "properties": {
        "root": {"type": "string", "minLength": 1},
        "image_size": {"type": "integer", "minimum": 8, "default": 28},
        "channels": {"type": "integer", "enum": [1, 3], "default": 1},
        "shard_mb": {"type": "number", "exclusiveMinimum": 0, "default": 256},
        "window": {"type": "integer", "minimum": 1, "default": 8192},
        "width": {"type": "integer", "minimum": 1, "default": 32},
    },
}
PREPARE_ARGS = ("root", "shard_mb")  # the shards hold the images' bytes, decoded in training


def classes(args: dict[str, Any]) -> list[str]:
    train = Path(args["root"]) / "train"
    found = sorted(p.name for p in train.iterdir() if p.is_dir()) if train.is_dir() else []
    if not found:
        raise ValueError(f"task_args.root {args['root']}: no class folders in {train} "
                         "(expected train/<class>/* and test/<class>/*)")  # fmt: skip
    return found


def prepare(data_dir: Path, args: dict[str, Any]) -> None:
    """Each split's images and labels into shards, in a seeded random order."""
    names = classes(args)
    for split in SPLITS:
        files = [(path, label) for label, name in enumerate(names)
                 for path in sorted((Path(args["root"]) / split / name).glob("*"))
                 if path.is_file()]  # fmt: skip
        random.Random(0).shuffle(files)  # the folders are sorted by class; the shards aren't
        with shards.Writer(data_dir / split, int(args["shard_mb"] * 2**20)) as writer:
            for path, label in files:
                writer.write({"img": path.read_bytes(), "cls": str(label).encode()})


def _decoder(args: dict[str, Any]) -> Any:
    mode, size = ("L" if args["channels"] == 1 else "RGB"), args["image_size"]

    def decode(sample: shards.Sample) -> tuple[torch.Tensor, int]:
        image = Image.open(io.BytesIO(sample["img"])).convert(mode).resize((size, size))
        pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
        x = pixels.view(size, size, -1).permute(2, 0, 1).float() / 127.5 - 1.0  # [-1, 1]
        return x, int(sample["cls"])

    return decode


def datasets(data_dir: Path, args: dict[str, Any]) -> tuple[shards.Sharded, shards.Sharded]:
    decode = _decoder(args)
    return tuple(shards.Sharded(data_dir / s, decode, window=args["window"]) for s in SPLITS)


def model(args: dict[str, Any]) -> nn.Module:
    width, size = args["width"], args["image_size"]
    return nn.Sequential(
        nn.Conv2d(args["channels"], width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(2 * width * (size // 4) ** 2, len(classes(args))),
    )  # fmt: skip
