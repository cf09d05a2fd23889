"""What the reproduction trains: the run's config as its record says it trained, at the
world size it started with, in a new run folder beside it, on the data it trained on."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from ddppipe.core.errors import UserError
from ddppipe.data import manifest
from ddppipe.reproduce.source import Recorded
from ddppipe.settings import layout, presets
from ddppipe.training.loop import pruning

SUFFIX = "-reproduced-"  # results/<run>-reproduced-<k>/


class NoData(FileNotFoundError, UserError):
    """No prepared data folder holds the files the run trained on."""


def workdir(recorded: Recorded) -> Path:
    """The working directory the run's workflow ran in (above its results folder)."""
    return layout.RunLayout.of_root(recorded.root).results.parent


def new_root(recorded: Recorded) -> Path:
    """A run folder that does not exist yet: ``<results>/<run>-reproduced-<k>``."""
    results = layout.RunLayout.of_root(recorded.root).results
    k = 1
    while (results / f"{recorded.root.name}{SUFFIX}{k}").exists():
        k += 1
    return results / f"{recorded.root.name}{SUFFIX}{k}"


# Settings of where a run trained that a reproduction elsewhere cannot honour and that change
# no number: a node-local folder (`$TMPDIR` exists inside a job only), dropped with a note.
NODE_LOCAL = {"launch": ("stage_data",)}


def dropped(recorded: Recorded) -> list[str]:
    """The node-local settings the reproduction drops, each in words."""
    cfg = recorded.config or {}
    return [f"{section}.{key}: {cfg[section][key]!r} dropped (a node-local setting of where "
            "the run trained; it changes no number): the reproduction reads the data where "
            "it is"
            for section, keys in NODE_LOCAL.items() for key in keys
            if (cfg.get(section) or {}).get(key) is not None]  # fmt: skip


def pruned_at(recorded: Recorded) -> int | None:
    """The epoch a sweep's trial was pruned at, as its final evaluation records it."""
    found = (recorded.evaluation or {}).get(pruning.PRUNED_AT)
    return int(found) if found is not None else None


def config(recorded: Recorded, run: str, gpu: bool) -> dict[str, Any]:
    """The resolved config of the reproduction ``run``: the run's own, with the record's train
    config (but ``precision: auto`` where the run's config says so: decided by the devices
    that train the reproduction, the run's identity kept) and task_args, one node of its first
    world size, on a GPU only when it trained on one and ``gpu`` (this machine has one), no
    tracking server, no node-local setting (:func:`dropped`), no sweep: a pruned trial stops
    at the epoch it was pruned at (its schedule kept: its trial section, the study not asked)."""
    if recorded.config is None:
        raise UserError(f"{recorded.root}/config.yaml missing: the run's resolved config is "
                        "needed to train it again")  # fmt: skip
    cfg = copy.deepcopy(recorded.config)
    record = recorded.provenance
    cfg["run"] = run
    cfg["train"].update(record["train_config"])
    if recorded.config["train"].get("precision") == presets.AUTO:  # its devices decide
        cfg["train"]["precision"] = presets.AUTO
    if record.get("task_args") is not None:
        cfg["task_args"] = record["task_args"]
    on_gpu = gpu and record["training"]["device"] == "cuda"
    cfg["launch"].update(nnodes=1, nproc_per_node=recorded.first_world_size,
                         strategy=record["training"].get("strategy", "ddp"),
                         device="gpu" if on_gpu else "cpu")  # fmt: skip
    cfg["resolved"] = {**cfg.get("resolved", {}), "device": "gpu" if on_gpu else "cpu"}
    cfg["tracking"] = {**cfg.get("tracking", {}), "mlflow": None}
    for section, keys in NODE_LOCAL.items():
        for key in keys:
            if key in cfg.get(section, {}):
                cfg[section][key] = None
    at = pruned_at(recorded)
    trial = recorded.config.get("trial")
    if at is not None and trial and trial.get("prune"):
        cfg["trial"] = {k: v for k, v in trial.items() if k != "pack"}  # not in allocations
        cfg["trial"]["prune"] = {**trial["prune"], "at_epoch": at}
    else:
        cfg["trial"] = None
    return cfg


def data_folder(recorded: Recorded, given: Path | None) -> Path:
    """``given``, else the prepared folder under ``resources/`` whose manifest lists the files
    the run trained on (with their recorded SHA-256 when one does); raise :class:`NoData`."""
    if given is not None:
        return Path(given)
    want = recorded.provenance.get("data_sha256") or {}
    named = []
    for found in sorted((workdir(recorded) / "resources").glob(f"*/{manifest.NAME}")):
        files = json.loads(found.read_text()).get("files", {})
        if set(files) != set(want):
            continue
        if all(files[k]["sha256"] == v for k, v in want.items()):
            return found.parent
        named.append(found.parent)
    if named:
        return named[0]  # its files are checked (and the changed one named) before training
    raise NoData(
        f"no folder under {workdir(recorded) / 'resources'} holds the run's data files "
        f"({', '.join(sorted(want))}): prepare it (snakemake --cores all prepare_data), or "
        "give its folder with --data"
    )
