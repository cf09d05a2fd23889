"""The training subcommands that run no training: export a result, and the environment check.

Imports are inside each command: export must not load torch (the export rule's budget).
"""

from __future__ import annotations

import json
from pathlib import Path


def export(
    result: Path, record: Path | None, config_path: Path, data: Path | None, out: Path,
    provenance: Path, image_info: Path | None, layer_info: Path | None, attempts: Path | None,
) -> int:  # fmt: skip
    """``ddppipe export``: publish the result (weights, or a script's outputs) to ``out`` and
    write its provenance record."""
    from ddppipe.apptainer import identity
    from ddppipe.core import atomic
    from ddppipe.runstate import publish
    from ddppipe.settings import config, run_spec
    from ddppipe.training.tracking import provenance as ddp_provenance

    spec = run_spec.load(config_path)
    image = json.loads(Path(image_info).read_text()) if image_info else None
    if image is not None:  # with its task layer (container.requirements), if it has one
        found = json.loads(Path(layer_info).read_text()) if layer_info else None
        image = identity.container_record(image, found)
    history = json.loads(attempts.read_text()) if attempts else None
    if spec.kind == "script":
        publish.copy_tree(result, out)
        found = ddp_provenance.script_record(spec, out, image, history)
    else:
        if record is None:
            raise config.ConfigError("ddppipe export: a task run needs --record")
        publish.copy_file(result, out)
        final = json.loads(record.read_text())
        found = ddp_provenance.record(final, data, image, history)
    if spec.trial is not None:  # a sweep's trial: which sweep, which values
        found["sweep"] = {"name": spec.trial.sweep, "trial": spec.trial.name,
                          "values": dict(spec.trial.values)}  # fmt: skip
    atomic.write_json(provenance, found)
    return 0


def selfcheck() -> int:
    """``ddppipe selfcheck``: print versions and the result of a one-process DDP smoke test."""
    from ddppipe.training.loop import selfcheck as checks

    print(json.dumps(checks.run(), indent=2))
    return 0


def time_loader(
    config_path: Path, data: Path, steps: int, world_size: int | None, rank: int
) -> int:
    """``ddppipe time-loader``: one rank's loader read alone; its figures on one line."""
    from ddppipe.settings import config, run_spec
    from ddppipe.training.measuring import loader_timing

    spec = run_spec.load(config_path)
    if spec.kind == "script":
        raise config.ConfigError(
            "ddppipe time-loader: a torchrun script's run has no ddppipe loader to time"
        )
    world = world_size or spec.launch.nnodes * spec.launch.nproc_per_node
    print(loader_timing.time_loader(spec, data, steps, world, rank).line())
    return 0
