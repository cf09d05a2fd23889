"""Room on disk for an image build, checked before it starts.

``apptainer build`` unpacks the image's whole root file system into its temporary folder
(``APPTAINER_TMPDIR``, else ``TMPDIR``, else ``/tmp``: often small on a login node) and then
writes the compressed image beside its destination; a disk that fills up fails it after
minutes. The need is sized by the wheels the build installs (torch's CUDA wheels are most of
the image): measured on the training image (containers/ddppipe.def, 2026-11-29), 3.0 GB of
wheels unpacked to 5.5 GB beside 0.5 GB of Debian, compressed to a 3.2 GB image.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ddppipe.apptainer.tool import ContainerError

GB = 1000**3
UNPACKED_PER_WHEEL_BYTE = 2.0  # installed size per byte of wheel (5.5 GB from 3.0), rounded up
IMAGE_PER_WHEEL_BYTE = 1.2  # the compressed image per byte of wheel (3.2 GB from 3.0), rounded up
BASE_BYTES = 1 * GB  # the debootstrapped OS, apt's files, the venv's other packages


def temp_folder() -> Path:
    """Where ``apptainer build`` unpacks the image: APPTAINER_TMPDIR, else TMPDIR, else /tmp."""
    return Path(os.environ.get("APPTAINER_TMPDIR") or os.environ.get("TMPDIR") or "/tmp")


def wheels_bytes(wheelhouse: Path | None) -> int:
    """The size of the wheels in ``wheelhouse`` (0 without one)."""
    if wheelhouse is None or not wheelhouse.is_dir():
        return 0
    return sum(p.stat().st_size for p in wheelhouse.glob("*.whl") if p.is_file())


def needs(wheels: int, image: Path) -> dict[Path, tuple[str, int]]:
    """The room the build of ``image`` takes, by folder: what it holds there and its bytes."""
    return {
        temp_folder(): ("the unpacked image", int(BASE_BYTES + UNPACKED_PER_WHEEL_BYTE * wheels)),
        image.parent: ("the image", int(BASE_BYTES / 2 + IMAGE_PER_WHEEL_BYTE * wheels)),
    }


def _existing(path: Path) -> Path:
    """``path`` or its nearest folder that exists (the image's folder may be made later)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def shortfall(wanted: dict[Path, tuple[str, int]]) -> str | None:
    """What lacks room, in words (None when every file system has enough); folders on one file
    system share its free bytes."""
    by_device: dict[int, list[tuple[Path, str, int]]] = {}
    for folder, (what, size) in wanted.items():
        by_device.setdefault(os.stat(_existing(folder)).st_dev, []).append((folder, what, size))
    short = []
    for places in by_device.values():
        free = shutil.disk_usage(_existing(places[0][0])).free
        need = sum(size for _, _, size in places)
        if free < need:
            parts = " and ".join(f"{size / GB:.1f} GB in {folder} ({what})"
                                 for folder, what, size in places)  # fmt: skip
            short.append(f"{parts}: {free / GB:.1f} GB free there")
    return "; ".join(short) or None


def check(wheelhouse: Path | None, image: Path) -> None:
    """Raise :class:`ContainerError` when the build of ``image`` (installing ``wheelhouse``'s
    wheels) would not fit, before anything is written."""
    found = shortfall(needs(wheels_bytes(wheelhouse), image))
    if found:
        raise ContainerError(
            f"not enough disk for the image build: it needs about {found}. Free space there, or "
            "point APPTAINER_TMPDIR at a folder with room for the unpacked image (a scratch or "
            "node-local file system; the image itself is written where container.image says)"
        )
