"""A folder of images, one sub-folder per class (``root/<class>/*.png``), trained by a small CNN.

Two layouts of ``task_args.root`` (a path, relative to the working directory or absolute):

- ``root/train/<class>/*`` and ``root/test/<class>/*``: the split is yours (both must hold
  the same classes);
- ``root/<class>/*``: split here, stratified and seeded: ``round(n * test_fraction)`` images
  of each class of ``n`` (at least one; every class needs two images or more) go to the test
  set.

Images are what torchvision's ``ImageFolder`` reads (``.png``, ``.jpg``, ``.jpeg``, ``.bmp``,
``.ppm``, ``.pgm``, ``.tif``, ``.tiff``, ``.webp``); classes are the sub-folder names, sorted
(their order is the class index). The images stay in ``root``, which the training nodes must
see at the same path; ``prepare`` checks the layout and writes ``index.json`` into the data
folder: the classes and every image's path (relative to ``root``), class, split and SHA-256,
so the run's data manifest covers the images' content. ``datasets`` reads the images with
``ImageFolder`` in the DataLoader workers (Resize to ``image_size``², ``Grayscale`` for one
channel, ToTensor, Normalize to [-1, 1]) and refuses to train when ``root`` no longer
matches the index (a class or an image added or removed; an image changed in place: its size
or mtime not the one ``prepare`` recorded, and its SHA-256 not the index's): Snakemake does
not watch ``root``, so after changing the images prepare again (``snakemake --forcerun
prepare_data``). ``model`` counts the class folders of
``root`` itself, so it works before ``prepare`` and always agrees with the data.

``pack: true`` (:mod:`ddppipe.data.packed`): ``prepare`` also decodes every image once
(Grayscale, Resize) into one uint8 file per split in the data folder (``train.npy``,
``test.npy``, with their labels), and training reads batches from those, memory-mapped: one
file opened per epoch instead of one per image, no decode per epoch, the same tensors as the
loose images give. ``root``'s class folders are still read (the model's classes).
``data.pack: squashfs`` (:mod:`ddppipe.data.squashfs`, the pipeline's setting) packs ``root``
itself, the image files as they are, into one SquashFS image that training reads in its place.

Preparing again reads only what changed: the digests of images whose size and mtime are
those of the last prepare are taken from its stat cache (:mod:`ddppipe.data.file_digests`,
one file per class folder in ``.cache/`` of the data folder, no part of the data), and the
pack's rows of unchanged images are copied, not decoded again.

``task_args``: ``root`` (required), ``image_size`` (32; 8 or more), ``channels`` (3; 1 for grey),
``width`` (32: channels of the first convolution), ``test_fraction`` (0.2) and
``split_seed`` (0) (both ignored with train/ and test/ folders), ``pack`` (false).
"""

from __future__ import annotations

import io
import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, Subset

from ddppipe.core import atomic, hashing
from ddppipe.core.errors import UserError
from ddppipe.data import file_digests, manifest, packed, squashfs
from ddppipe.tasks import image_index
from ddppipe.tasks.split import stratified

log = logging.getLogger(__name__)

INDEX = "index.json"
OLD_STATS = "imagefolder-stats.json"  # the stat cache of earlier versions: one JSON file
# What the data folder depends on: the index, and the pack's decoded images.
PREPARE_ARGS = ("root", "test_fraction", "split_seed", "pack", "image_size", "channels")
FOLDER_ARG = "root"  # the folder data.pack: squashfs packs (ddppipe.data.squashfs)
FORMAT = 1
SPLITS = ("train", "test")
# What ImageFolder reads (torchvision.datasets.folder.IMG_EXTENSIONS, held here: prepare imports
# no torchvision, seconds of a re-prepare; a test compares them).
EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")

ARGS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["root"],
    "properties": {
        "root": {"type": "string", "minLength": 1},
        "image_size": {"type": "integer", "minimum": 8, "default": 32},
        "channels": {"type": "integer", "enum": [1, 3], "default": 3},
        "width": {"type": "integer", "minimum": 1, "default": 32},
        "test_fraction": {
            "type": "number",
            "exclusiveMinimum": 0,
            "exclusiveMaximum": 1,
            "default": 0.2,
        },
        "split_seed": {"type": "integer", "minimum": 0, "default": 0},
        "pack": {"type": "boolean", "default": False},
    },
}


class ImageFolderError(ValueError, UserError):
    """The image folder is missing, malformed, or no longer what ``prepare`` indexed."""


def _root(args: dict[str, Any]) -> Path:
    root = Path(args["root"]).expanduser()
    if not root.is_dir():
        raise ImageFolderError(
            f"task_args.root: no folder {root.absolute()}: point it at a folder of class "
            "folders (root/<class>/*.png), or of train/ and test/ folders of class folders"
        )
    return root


def _split_folders(root: Path) -> dict[str, Path] | None:
    """``{"train": root/train, "test": root/test}`` for the split layout, None for classes."""
    present = [s for s in SPLITS if (root / s).is_dir()]
    if not present:
        return None
    if len(present) == 1:
        missing = root / next(s for s in SPLITS if s not in present)
        raise ImageFolderError(
            f"{root} has {present[0]}/ but no {missing.name}/: add {missing} with the same "
            "class folders, or put the class folders directly in root (split by test_fraction)"
        )
    return {s: root / s for s in SPLITS}


def _classes(folder: Path) -> list[str]:
    """The class folders of ``folder``, sorted, as ``ImageFolder`` finds them (torchvision's
    ``find_classes``: the entries that are folders, links to folders included)."""
    try:
        with os.scandir(folder) as entries:
            names = sorted(entry.name for entry in entries if entry.is_dir())
    except FileNotFoundError:
        names = []
    if not names:
        raise ImageFolderError(
            f"{folder} holds no class folders: put each class's images in a folder named "
            f"after the class ({folder}/<class>/*.png)"
        )
    return names


def classes(args: dict[str, Any]) -> list[str]:
    """The class names of ``task_args.root`` (of its train/ folder in the split layout)."""
    root = _root(args)
    splits = _split_folders(root)
    return _classes(splits["train"] if splits else root)


def _scan(folder: Path, names: list[str], root: Path) -> list[tuple[str, int]]:
    """(path relative to root, class index) of every image, as ``ImageFolder`` lists them
    (its ``make_dataset``: each class folder walked, links followed, sorted by folder then
    name; an image by its extension), the paths made here as text (a million of them)."""
    prefix = folder.relative_to(root).as_posix()
    prefix, extensions, samples = ("" if prefix == "." else prefix + "/"), EXTENSIONS, []
    for c, name in enumerate(names):
        top = os.path.join(folder, name)
        for where, _, files in sorted(os.walk(top, followlinks=True)):
            rel = prefix + name + where[len(top) :].replace(os.sep, "/")
            samples += [(f"{rel}/{f}", c) for f in sorted(files) if f.lower().endswith(extensions)]
    counts = np.bincount([c for _, c in samples], minlength=len(names))
    empty = [names[i] for i in np.flatnonzero(counts == 0)]
    if empty:
        raise ImageFolderError(
            f"class folder {folder / empty[0]} holds no images"
            + (f" (nor do {', '.join(empty[1:])})" if len(empty) > 1 else "")
            + f": add images ({', '.join(EXTENSIONS)}) or remove the folder"
        )
    return samples


def _discover(args: dict[str, Any]) -> tuple[list[str], list[tuple[str, int, str]]]:
    """The classes and every image's (path relative to root, class index, split)."""
    root = _root(args)
    splits = _split_folders(root)
    if splits:
        names = _classes(splits["train"])
        test_names = _classes(splits["test"])
        if test_names != names:
            only_train = sorted(set(names) - set(test_names)) or ["-"]
            only_test = sorted(set(test_names) - set(names)) or ["-"]
            raise ImageFolderError(
                f"{splits['train']} and {splits['test']} hold different class folders (only "
                f"in train/: {', '.join(only_train)}; only in test/: {', '.join(only_test)}): "
                "give both the same classes"
            )
        return names, [(path, c, split) for split in SPLITS
                       for path, c in _scan(splits[split], names, root)]  # fmt: skip
    names = _classes(root)
    samples = _scan(root, names, root)
    counts = np.bincount([c for _, c in samples], minlength=len(names))
    if counts.min() < 2:
        single = names[int(np.argmin(counts))]
        raise ImageFolderError(
            f"class folder {root / single} holds one image: splitting off a test set needs "
            "two or more per class; add images, or give root train/ and test/ folders"
        )
    labels = np.array([c for _, c in samples])
    test = set(stratified(labels, args["test_fraction"], args["split_seed"]).tolist())
    return names, [(path, c, "test" if i in test else "train")
                   for i, (path, c) in enumerate(samples)]  # fmt: skip


def _digest(path: Path) -> str:
    """SHA-256 of an image file, after checking that PIL can read it."""
    from PIL import Image

    data = path.read_bytes()
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.verify()
    except Exception as e:
        raise ImageFolderError(
            f"{path} is not a readable image ({type(e).__name__}: {e}): replace or remove it"
        ) from None
    return hashing.sha256(data)


def _decoder(root: Path, paths: list[str], args: dict[str, Any]) -> Any:
    """Row ``i`` of a pack: image ``paths[i]`` as the loose path gives it before ToTensor
    (RGB, then Grayscale, Resize), as a (channels, size, size) uint8 array."""
    from PIL import Image

    resize = _transform(args).transforms[:-2]  # the PIL steps: Grayscale?, Resize

    def decode(i: int) -> np.ndarray:
        with Image.open(root / paths[i]) as image:
            picture = image.convert("RGB")  # as ImageFolder's loader
        for step in resize:
            picture = step(picture)
        pixels = np.asarray(picture, dtype=np.uint8)
        return pixels[None] if pixels.ndim == 2 else pixels.transpose(2, 0, 1)

    return decode


def _pack(data_dir: Path, root: Path, index: dict[str, Any], args: dict[str, Any]) -> int:
    """Write each split's pack; return how many images were decoded (an image of the last
    packs, same path and digest, same shape, is copied from there: its split may differ)."""
    shape = _pack_shape(args)
    old_index = _read_index(data_dir)
    where: dict[tuple[str, str], tuple[np.ndarray, int]] = {}
    if old_index and (old_index.get("pack") or {}).get("shape") == shape:
        for split in SPLITS:
            old = [im for im in old_index["images"] if im["split"] == split]
            try:
                old_rows = packed.rows(Path(data_dir) / split)
            except (OSError, ValueError):
                continue
            if old_rows.shape[0] == len(old):
                where.update({(im["path"], im["sha256"]): (old_rows, j)
                              for j, im in enumerate(old)})  # fmt: skip
    # No index while the packs are rewritten: a prepare killed between them leaves none, and
    # the next one decodes every image rather than copy rows of a half-written set.
    (Path(data_dir) / INDEX).unlink(missing_ok=True)
    decoded, number = 0, {name: c for c, name in enumerate(index["classes"])}
    for split in SPLITS:
        images = [im for im in index["images"] if im["split"] == split]
        reuse = {i: where[key] for i, im in enumerate(images)
                 if (key := (im["path"], im["sha256"])) in where}  # fmt: skip
        decoded += packed.write(
            Path(data_dir) / split, shape,
            [number[im["class"]] for im in images],
            _decoder(root, [im["path"] for im in images], args), reuse, workers=4,
        )  # fmt: skip
    return decoded


def _pack_shape(args: dict[str, Any]) -> list[int]:
    """A packed image's shape: (channels, size, size), as the index records it."""
    return [args["channels"], args["image_size"], args["image_size"]]


def _read_index(data_dir: Path) -> dict[str, Any] | None:
    try:
        index = json.loads((Path(data_dir) / INDEX).read_text())
    except (OSError, ValueError):
        return None
    return index if index.get("format") == FORMAT else None


def _split_args(root: Path, args: dict[str, Any]) -> dict[str, Any] | None:
    if _split_folders(root):
        return None
    return {"test_fraction": float(args["test_fraction"]), "split_seed": int(args["split_seed"])}


def prepare(data_dir: Path, args: dict[str, Any]) -> None:
    """Check the layout and write ``index.json`` (atomically; untouched when unchanged), and
    with ``pack`` the packs of the decoded images; only new or changed images are read."""
    root = _root(args)
    names, images = _discover(args)
    cache = Path(data_dir) / manifest.CACHE
    (cache / OLD_STATS).unlink(missing_ok=True)
    groups = image_index.groups(images, names, _split_folders(root) is not None)
    digests, read = file_digests.digests(root, groups, cache, _digest)
    head = {
        "format": FORMAT,
        "classes": names,
        "split": _split_args(root, args),
        "counts": {s: sum(split == s for _, _, split in images) for s in SPLITS},
        "pack": {"shape": _pack_shape(args)} if args["pack"] else None,
    }
    text = image_index.text(head, images, digests)
    dest = Path(data_dir) / INDEX
    unchanged = dest.is_file() and dest.read_text() == text
    decoded = 0
    if args["pack"] and not (unchanged and all(
        p.is_file() for s in SPLITS for p in packed.paths(Path(data_dir) / s)
    )):  # fmt: skip
        index = {**head, "images": [
            {"path": path, "class": names[c], "split": split, "sha256": digest}
            for (path, c, split), digest in zip(images, digests, strict=True)
        ]}  # fmt: skip
        decoded = _pack(Path(data_dir), root, index, args)  # removes the index meanwhile
        unchanged = False
    if not args["pack"]:
        for split in SPLITS:
            for path in packed.paths(Path(data_dir) / split):
                path.unlink(missing_ok=True)  # an earlier pack's: no data of this index
    log.info("%s: %d image(s), %d read (new or changed), %d decoded into packs",
             root, len(images), read, decoded)  # fmt: skip
    if not unchanged:
        atomic.write_text(dest, text)


def _transform(args: dict[str, Any]) -> Any:
    from torchvision import transforms

    size, channels = args["image_size"], args["channels"]
    steps = [transforms.Grayscale(1)] if channels == 1 else []
    return transforms.Compose([
        *steps,
        transforms.Resize((size, size)),
        transforms.ToTensor(),
        transforms.Normalize([0.5] * channels, [0.5] * channels),
    ])  # fmt: skip


def _normalize(pixels: torch.Tensor) -> torch.Tensor:
    """A pack's uint8 batch as the loose path's ToTensor and Normalize give it: [-1, 1]."""
    return pixels.to(torch.float32).div_(255).sub_(0.5).div_(0.5)


def _refuse_changed(data_dir: Path, root: Path, index: dict[str, Any], split_layout: bool,
                    redo: str) -> None:  # fmt: skip
    """Refuse images changed in place since the index (:func:`image_index.changed`); not
    those of the data folder's SquashFS image (``data.pack: squashfs``: root is its content,
    which the data manifest covers and every rank checks)."""
    try:
        in_image = squashfs.KEY in manifest.read(data_dir)
    except manifest.ManifestError:  # (prepared by hand: no manifest)
        in_image = False
    if in_image:
        return
    if bad := image_index.changed(data_dir, root, index, split_layout):
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise ImageFolderError(f"{redo} (changed in place: {', '.join(bad[:3])}{more}: not the "
                               "content whose SHA-256 the index records)")  # fmt: skip


def datasets(data_dir: Path, args: dict[str, Any]) -> tuple[Dataset, Dataset]:
    """Train and test datasets of ``(image tensor (channels, size, size), class index)``."""
    from torchvision.datasets import ImageFolder

    path = Path(data_dir) / INDEX
    if not path.is_file():
        raise ImageFolderError(f"{path} is missing: run the task's prepare() first")
    index = json.loads(path.read_text())
    root = _root(args)
    again = "prepare the data again (snakemake --forcerun prepare_data)"
    redo = f"{root} changed since {path} was written: {again}"
    shape = _pack_shape(args) if args["pack"] else None
    if (index.get("format") != FORMAT or index.get("split") != _split_args(root, args)
            or (index.get("pack") or {}).get("shape") != shape):  # fmt: skip
        raise ImageFolderError(f"{path} was written for other task_args: {again}")
    if args["pack"]:  # the decoded images, as prepared (the data manifest checked them)
        if (names := classes(args)) != index["classes"]:
            raise ImageFolderError(f"{redo} (its classes are now {', '.join(names)})")
        return tuple(packed.Packed(Path(data_dir) / s, _normalize) for s in SPLITS)
    splits = _split_folders(root)
    for folder in splits.values() if splits else [root]:
        if (names := _classes(folder)) != index["classes"]:
            raise ImageFolderError(f"{redo} ({folder}'s classes are now {', '.join(names)})")
    indexed = {s: [im["path"] for im in index["images"] if im["split"] == s] for s in SPLITS}
    transform = _transform(args)
    if splits:
        parts = {s: ImageFolder(splits[s], transform) for s in SPLITS}
        for s, part in parts.items():
            found = [Path(p).relative_to(root).as_posix() for p, _ in part.samples]
            if found != indexed[s]:
                raise ImageFolderError(
                    f"{redo} ({s}/: {image_index.differences(found, indexed[s])})"
                )
        _refuse_changed(data_dir, root, index, True, redo)
        return parts["train"], parts["test"]
    full = ImageFolder(root, transform)
    found = [Path(p).relative_to(root).as_posix() for p, _ in full.samples]
    if sorted(found) != sorted(indexed["train"] + indexed["test"]):
        raise ImageFolderError(
            f"{redo} ({image_index.differences(found, indexed['train'] + indexed['test'])})"
        )
    _refuse_changed(data_dir, root, index, False, redo)
    test = set(indexed["test"])
    return (
        Subset(full, [i for i, p in enumerate(found) if p not in test]),
        Subset(full, [i for i, p in enumerate(found) if p in test]),
    )


def _block(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU()
    )


class Net(nn.Module):
    """Three conv-BN-ReLU blocks (w, 2w, 4w channels; max-pools between), global average
    pooling, then a linear layer: logits for ``channels`` x size x size images of any size."""

    def __init__(self, channels: int, num_classes: int, width: int = 32) -> None:
        super().__init__()
        self.features = nn.Sequential(
            _block(channels, width), nn.MaxPool2d(2),
            _block(width, 2 * width), nn.MaxPool2d(2),
            _block(2 * width, 4 * width), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )  # fmt: skip
        self.dropout = nn.Dropout(0.25)
        self.fc = nn.Linear(4 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.dropout(self.features(x)))


def model(args: dict[str, Any]) -> nn.Module:
    """The CNN, with one output per class folder of ``root`` (no need for ``prepare``)."""
    return Net(args["channels"], len(classes(args)), args["width"])
