"""Provenance of a trained model: code, software, hardware, data and config."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddppipe import __version__
from ddppipe.core import system
from ddppipe.core.errors import UserError
from ddppipe.data import manifest
from ddppipe.parallel import software
from ddppipe.runstate import origin
from ddppipe.settings import run_spec

if TYPE_CHECKING:
    from ddppipe.parallel.distributed import Context


def meta(
    spec: run_spec.RunSpec, ctx: Context, hosts: list[str],
    precision: dict[str, Any] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """What a checkpoint records of the training that wrote it (``hosts``: each rank's;
    ``precision``: the ranks' decision, :mod:`ddppipe.parallel.precision`), read back by
    :func:`record`."""
    import torch

    cuda = ctx.device.type == "cuda"
    return {
        "world_size": ctx.world_size,
        "strategy": spec.launch.strategy,
        "hosts": hosts,
        "backend": ctx.backend,
        "launcher": ctx.launcher,
        "device": ctx.device.type,
        "device_name": torch.cuda.get_device_name(ctx.device) if cuda else "cpu",
        "torch": str(torch.__version__),
        "ddppipe": __version__,
        "software": software.stack(),
        "seed": spec.train.seed,
        "precision": precision,
        "train": dataclasses.asdict(spec.train),  # its precision as the ranks decided it
        "task": run_spec.plain(spec.task_source),
        "task_args": run_spec.plain(spec.task_args),
    }


class DataChanged(RuntimeError, UserError):
    """The data folder is not what the run's training started from."""


def data_checksums(data_dir: Path, digest: str | None = None) -> dict[str, str]:
    """SHA-256 of every file the task prepared (from its checked manifest); with ``digest``
    (the manifest's when the training started), raise :class:`DataChanged` if it is another's."""
    found = manifest.check(data_dir)
    if digest is not None and found.get("digest") != digest:
        raise DataChanged(
            f"{data_dir}: its manifest's digest is {found.get('digest')}, the training started "
            f"on data of digest {digest}: the data was prepared again since. The provenance "
            "would name other data than trained: restore the data the run trained on, or "
            "train the run again on this data"
        )
    return {rel: f["sha256"] for rel, f in found["files"].items()}


def started(attempts: list[dict[str, Any]] | None) -> dict[str, Any]:
    """What the training started from (:func:`ddppipe.runstate.origin.started`): the git
    commit and data digest of the slot it started in; a run whose attempts recorded none (one
    trained before ddppipe recorded them): the commit now, no digest."""
    began = origin.started(attempts or [])
    if began is None:
        return {"git": system.git_commit(), "data": None}
    return began[1]


def record(
    final: dict[str, Any],
    data_dir: Path,
    image: dict[str, Any] | None = None,
    attempts: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The provenance of a final training snapshot (``final``: its epochs, config hash and
    meta, :func:`ddppipe.training.checkpoints.checkpoint.record`)."""
    meta, began = final["meta"], started(attempts)
    return {
        "git": began["git"],  # when the training started (its first slot), not now
        # the stack that trained (recorded by rank 0), not the one that exports
        "software": meta.get("software") or software.stack(),
        "training": {
            "world_size": meta["world_size"],
            "strategy": meta.get("strategy", "ddp"),  # launch.strategy (ddp before it existed)
            "hosts": sorted(set(meta["hosts"])),
            "rank_hosts": meta["hosts"],
            "backend": meta["backend"],
            "launcher": meta["launcher"],
            "device": meta["device"],
            "device_name": meta["device_name"],
            "torch": meta["torch"],
            "ddppipe": meta["ddppipe"],
            "precision": meta.get("precision"),  # configured, trained, where bf16 is emulated
        },
        "seed": meta["seed"],
        "epochs": final["epoch"],
        "config_hash": final["config_hash"],
        "train_config": meta["train"],
        "task": meta.get("task"),  # file, SHA-256, version of the task that trained
        "task_args": meta.get("task_args"),
        "data_sha256": data_checksums(data_dir, began["data"]),
        "container": image,
        "attempts": attempts,
    }


SNAKEMAKE_MARK = ".snakemake_timestamp"  # Snakemake's file in a directory() output: not the run's


def script_record(
    spec: run_spec.RunSpec,
    outputs: Path,
    image: dict[str, Any] | None = None,
    attempts: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The provenance of a script run: the script (file, SHA-256, arguments), its outputs."""
    from ddppipe.core import hashing

    files = sorted(p for p in Path(outputs).rglob("*")
                   if p.is_file() and p.name != SNAKEMAKE_MARK)  # fmt: skip
    return {
        "git": started(attempts)["git"],
        "software": software.stack(),  # the launcher's stack; the script's own may differ
        "script": {**run_spec.plain(spec.task_source), "args": list(spec.script_args)},
        "world_size": spec.world_size,
        "outputs_sha256": {str(p.relative_to(outputs)): hashing.file_sha256(p) for p in files},
        "container": image,
        "attempts": attempts,
    }
