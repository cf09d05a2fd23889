"""Tiny packages written by a test, so an install needs no package index: pure-Python wheels,
and source distributions whose build imports torch."""

from __future__ import annotations

import base64
import gzip
import hashlib
import io
import tarfile
import zipfile
from pathlib import Path


def _record_line(path: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


def wheel_of(folder: Path, name: str, version: str, files: dict[str, str]) -> Path:
    """``folder/<name>-<version>-py3-none-any.whl`` (no dependency) holding ``files`` (path in
    the wheel -> text)."""
    info = f"{name.replace('-', '_')}-{version}.dist-info"
    data = {path: text.encode() for path, text in files.items()}
    data[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode()
    data[f"{info}/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: ddppipe-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    record = [_record_line(path, content) for path, content in data.items()]
    data[f"{info}/RECORD"] = ("\n".join([*record, f"{info}/RECORD,,"]) + "\n").encode()
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for path, content in data.items():
            z.writestr(path, content)
    return wheel


def write_wheel(folder: Path, name: str, version: str, module: str) -> Path:
    """The wheel of the package ``name``, its import ``name`` holding ``module`` (Python
    source) and ``__version__``."""
    return wheel_of(
        folder, name, version, {f"{name}/__init__.py": f"{module}\n__version__ = {version!r}\n"}
    )


def sdist_of(folder: Path, name: str, version: str, files: dict[str, str]) -> Path:
    """``folder/<name>-<version>.tar.gz``: a source distribution holding ``files`` (its
    setup.py among them) and its PKG-INFO, the same bytes every time."""
    folder.mkdir(parents=True, exist_ok=True)
    pkg_info = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    tar = io.BytesIO()
    with tarfile.open(fileobj=tar, mode="w") as t:
        for path, text in sorted({**files, "PKG-INFO": pkg_info}.items()):
            member = tarfile.TarInfo(f"{name}-{version}/{path}")
            member.size, member.mtime, member.mode = len(text.encode()), 0, 0o644
            t.addfile(member, io.BytesIO(text.encode()))
    sdist = folder / f"{name}-{version}.tar.gz"
    sdist.write_bytes(gzip.compress(tar.getvalue(), mtime=0))
    return sdist


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


# torchver: a source distribution whose build requires and imports torch (as a PyTorch
# extension's does) and writes the version it built against into the package (as an
# extension's ABI records it). In an isolated build, pip would install the newest torch of the
# index for it (none without one).
TORCHVER_PYPROJECT = """\
[build-system]
requires = ["setuptools", "torch"]
build-backend = "setuptools.build_meta"
"""
TORCHVER_SETUP = """\
import os

import torch
from setuptools import setup

os.makedirs("torchver", exist_ok=True)
with open("torchver/_built.py", "w") as out:
    out.write(f"TORCH = {torch.__version__!r}\\n")
setup(name="torchver", version="1.0", packages=["torchver"])
"""


def torchver_sdist(folder: Path) -> Path:
    """``folder/torchver-1.0.tar.gz``: its build requires and imports torch;
    ``torchver.TORCH`` the version it imported."""
    return sdist_of(folder, "torchver", "1.0", {
        "pyproject.toml": TORCHVER_PYPROJECT,
        "setup.py": TORCHVER_SETUP,
        "torchver/__init__.py": "from torchver._built import TORCH\n",
    })  # fmt: skip


# cppext: a C++ extension over torch's headers (torch.utils.cpp_extension), as a user's own op.
CPPEXT_SETUP = """\
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

setup(name="cppext", version="1.0", packages=["cppext"],
      ext_modules=[CppExtension("cppext._ops", ["cppext/ops.cpp"])],
      cmdclass={"build_ext": BuildExtension})
"""
CPPEXT_OPS = """\
#include <torch/extension.h>

torch::Tensor twice(torch::Tensor x) { return x * 2; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("twice", &twice); }
"""


def cppext_sdist(folder: Path) -> Path:
    """``folder/cppext-1.0.tar.gz``: ``cppext._ops.twice`` compiled against torch's headers."""
    return sdist_of(folder, "cppext", "1.0", {
        "setup.py": CPPEXT_SETUP,
        "cppext/__init__.py": "import torch\n\nfrom cppext._ops import twice\n",
        "cppext/ops.cpp": CPPEXT_OPS,
    })  # fmt: skip
