"""``imagefolder``'s index of a folder of images (``index.json``): its text, written by hand,
and a folder compared with it: the images added or removed since, and those changed in place.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from itertools import groupby
from pathlib import Path
from typing import Any

from ddppipe.core import hashing
from ddppipe.data import file_digests, manifest

Image = tuple[str, int, str]  # path relative to root, class index, split


def groups(images: Sequence[Image], names: list[str],
           split_layout: bool) -> list[tuple[str, list[str]]]:  # fmt: skip
    """The images' paths by class folder (``cat``, or ``train/cat`` in the split layout), in
    their order: the stat cache's groups."""

    def folder(image: Image) -> str:
        path, c, _ = image
        return f"{path.split('/', 1)[0]}/{names[c]}" if split_layout else names[c]

    return [(key, [path for path, _, _ in group]) for key, group in groupby(images, folder)]


def text(head: dict[str, Any], images: Sequence[Image], digests: Sequence[str]) -> str:
    """``json.dumps(index, indent=1) + "\n"`` of the index ``head`` with its ``images``, the
    images written here: the same text, in a second for a million images where the encoder
    (in Python when indenting) takes a minute."""
    dumped = json.dumps({**head, "images": None}, indent=1)
    assert dumped.endswith(' "images": null\n}') and images
    quote = json.encoder.encode_basestring_ascii  # what json.dumps writes a text with
    classes = [quote(name) for name in head["classes"]]
    rows = [
        f'  {{\n   "path": {quote(path)},\n   "class": {classes[c]},\n'
        f'   "split": "{split}",\n   "sha256": "{digest}"\n  }}'
        for (path, c, split), digest in zip(images, digests, strict=True)
    ]
    return dumped.removesuffix("null\n}") + "[\n" + ",\n".join(rows) + "\n ]\n}\n"


def differences(found: list[str], indexed: list[str]) -> str:
    """The images added and removed since the index, in words."""
    added, removed = sorted(set(found) - set(indexed)), sorted(set(indexed) - set(found))
    parts = [f"{len(added)} image(s) added (e.g. {added[0]})"] if added else []
    parts += [f"{len(removed)} removed (e.g. {removed[0]})"] if removed else []
    return ", ".join(parts) or "the images' order differs"


def changed(data_dir: Path, root: Path, index: dict[str, Any], split_layout: bool) -> list[str]:
    """The indexed images of ``root`` whose content is no longer the index's SHA-256: each
    image's size and mtime compared with those ``prepare`` recorded (the data folder's stat
    cache, :mod:`ddppipe.data.file_digests`), an image whose size or mtime moved (or with no
    record: a staged data folder has no cache) read and hashed again."""
    number = {name: c for c, name in enumerate(index["classes"])}
    images = [(im["path"], number[im["class"]], im["split"]) for im in index["images"]]
    found, _ = file_digests.changed(
        root, groups(images, index["classes"], split_layout), Path(data_dir) / manifest.CACHE,
        [im["sha256"] for im in index["images"]], hashing.file_sha256,
    )  # fmt: skip
    return found
