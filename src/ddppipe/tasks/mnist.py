"""MNIST (the default task): the seeds' CNN on the 70,000 official handwritten digits.

``prepare`` downloads the four IDX files from the first working mirror of
``task_args.mirrors`` and verifies their SHA-256 (:mod:`ddppipe.data.download`); ``datasets``
keeps them in memory as uint8 tensors, normalized per batch on the device; ``model`` is
:class:`ddppipe.tasks.model.Net` (its BatchNorm variant with ``batchnorm``, which the ``gpu`` preset
turns on). ``task_args`` (all optional): see ``mnist.args.yaml``.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

import yaml

# The files are verified against these checksums: from whichever mirror, the same bytes.
PREPARE_ARGS = ("sha256",)
ARGS_SCHEMA: dict[str, Any] = yaml.safe_load(
    resources.files("ddppipe.tasks").joinpath("mnist.args.yaml").read_text()
)


def prepare(data_dir: Path, args: dict[str, Any]) -> None:
    from ddppipe.data import download

    download.download_all(args, data_dir)


def datasets(data_dir: Path, args: dict[str, Any]) -> tuple[Any, Any]:
    from ddppipe.data import mnist_files
    from ddppipe.data.batches import Tensors

    data = mnist_files.load(data_dir)
    return (
        Tensors(data.train.images, data.train.labels, mnist_files.normalize),
        Tensors(data.test.images, data.test.labels, mnist_files.normalize),
    )


def model(args: dict[str, Any]) -> Any:
    from ddppipe.tasks.model import Net

    return Net(batchnorm=args.get("batchnorm", False))
