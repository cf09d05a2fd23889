"""The scaling study: a grid sweep named ``scaling`` over the launch keys.

The ``scaling:`` section's lists (``nodes``, ``procs_per_node``, ``cpus_per_proc``) are the
axes of a grid over ``launch.nnodes``, ``launch.nproc_per_node`` and ``launch.cpus_per_proc``.
Every combination is a trial of the sweep ``scaling`` (:mod:`ddppipe.settings.sweep`), an ordinary
run ``sweeps/scaling/<trial>`` named after its values
(``sweeps/scaling/nnodes=1+nproc_per_node=2+cpus_per_proc=1``), its config made by
:func:`ddppipe.settings.sweep.apply` from the base config with the study's ``epochs``. The global
batch stays the base config's, so every trial trains the same recipe and only the way the
work is spread changes. The study is not the ``sweep:`` section's sweep: it has a name of its
own, which a ``sweep:`` may not take.
"""

from __future__ import annotations

import copy
import math
from typing import Any

from ddppipe.settings import sweep as sweeps
from ddppipe.settings.config import ConfigError, schema

NAME = "scaling"  # the study's sweep: results/sweeps/scaling/, trials sweeps/scaling/<trial>
# Each list of the scaling: section and the launch key it is an axis of.
AXES = {
    "nodes": "launch.nnodes",
    "procs_per_node": "launch.nproc_per_node",
    "cpus_per_proc": "launch.cpus_per_proc",
}


def study(cfg: dict[str, Any]) -> sweeps.Sweep:
    """The config's scaling study as a grid sweep, each axis's values in ascending order.

    Raise ConfigError when the ``sweep:`` section takes the study's name: two sweeps never
    share a name (a folder, a table).
    """
    if (cfg.get("sweep") or {}).get("name") == NAME:
        raise ConfigError(
            f"sweep.name: {NAME!r} is the scaling study's sweep (results/sweeps/{NAME}/, "
            f"`snakemake {NAME}`, defined by the scaling: section); give your sweep another name"
        )
    section = cfg["scaling"]
    parameters = tuple(
        sweeps.Parameter(key, values=tuple(sorted(section[axis]))) for axis, key in AXES.items()
    )
    defaults = {
        k: v.get("default") for k, v in schema()["properties"]["sweep"]["properties"].items()
    }
    size = math.prod(len(p.values or ()) for p in parameters)
    return sweeps.Sweep(
        name=NAME, parameters=parameters, method="grid", trials=size, seed=defaults["seed"],
        metric=defaults["metric"], direction=defaults["direction"],
        max_parallel=size,  # no slot limit of its own: Snakemake's --cores (or SLURM) decide
        prune="none", prune_warmup_epochs=0,
    )  # fmt: skip


def apply(cfg: dict[str, Any], study_sweep: sweeps.Sweep, trial: sweeps.Trial) -> dict[str, Any]:
    """The config of the study's ``trial``: the trial's launch settings and the study's
    ``epochs`` (``null``: the base config's) over the base config, as any sweep's trial."""
    base = copy.deepcopy(cfg)
    epochs = base["scaling"]["epochs"]
    if epochs is not None:
        base["train"]["epochs"] = epochs
    return sweeps.apply(base, study_sweep, trial)
