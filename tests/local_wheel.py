"""A tiny pure-Python wheel written by a test, so an install needs no package index."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path


def _record_line(path: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


def write_wheel(folder: Path, name: str, version: str, module: str) -> Path:
    """``folder/<name>-<version>-py3-none-any.whl``: the package ``name`` (no dependency),
    its import ``name`` holding ``module`` (Python source) and ``__version__``."""
    info = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": f"{module}\n__version__ = {version!r}\n".encode(),
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: ddppipe-tests\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n",
    }
    record = [_record_line(path, data) for path, data in files.items()] + [f"{info}/RECORD,,"]
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for path, data in files.items():
            z.writestr(path, data)
    return wheel


# blobfmt: the package of tests/data/blobsdep.py (a user's task), found on no index.
BLOBFMT = """\
def intcomma(n: int) -> str:
    return f"{n:,}"


def naturalsize(size: int) -> str:
    return f"{size / 1000:.1f} kB"
"""


def blobfmt_wheels(folder: Path, *versions: str) -> Path:
    """``folder`` holding a blobfmt wheel of each of ``versions`` (pip's ``--find-links``)."""
    for version in versions:
        write_wheel(folder, "blobfmt", version, BLOBFMT)
    return folder
