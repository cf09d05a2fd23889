"""SLURM: the train rule's Snakemake resources, request checks, and the job's node list.

The request shape is one ``torchrun`` task per node (``--ntasks-per-node=1``) that starts
``launch.nproc_per_node`` training processes, so a task needs the CPUs of all of them.
Nodes are ``launch.nnodes`` (also the world size's node count), processes per node are
``launch.nproc_per_node``; everything else comes from the ``slurm:`` config section.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from typing import Any

import hostlist

from ddppipe import config as ddp_config
from ddppipe import scaling

# Every resource resources() may set (None where a config leaves it out).
RESOURCE_KEYS = (
    "nodes", "tasks", "cpus_per_task", "mem_mb", "runtime", "slurm_partition", "slurm_account",
    "constraint", "qos", "mpi", "gres", "tasks_per_gpu", "slurm_extra",
)  # fmt: skip


class SlurmRequestError(ValueError):
    """The SLURM request the config describes cannot work; the message says how to fix it."""


def validate(cfg: dict[str, Any]) -> None:
    """Raise SlurmRequestError for a request SLURM would reject or training could not use."""
    launch, slurm = cfg["launch"], cfg["slurm"]
    nodes, nproc, gpus = launch["nnodes"], launch["nproc_per_node"], slurm["gpus_per_node"]
    if nodes < 1:
        raise SlurmRequestError(f"launch.nnodes is {nodes}; request at least 1 node")
    if gpus and gpus != nproc:
        raise SlurmRequestError(
            f"slurm.gpus_per_node ({gpus}) must equal launch.nproc_per_node ({nproc}): "
            "one training process per GPU; set both to the same value (or gpus_per_node: 0)"
        )
    try:
        ddp_config.resolve(cfg)  # checks the global batch divides by nodes x processes
    except ddp_config.ConfigError as e:
        raise SlurmRequestError(str(e)) from e


def resources(cfg: dict[str, Any]) -> dict[str, Any]:
    """Snakemake resources of the train rule for the SLURM executor plugin (validated)."""
    cfg = ddp_config.validate(json.loads(json.dumps(cfg)))
    validate(cfg)
    launch, slurm = cfg["launch"], cfg["slurm"]
    nodes, nproc, gpus = launch["nnodes"], launch["nproc_per_node"], slurm["gpus_per_node"]
    # --requeue comes from the profile (slurm-requeue), so the plugin knows SLURM requeues.
    extra = [f"--ntasks-per-node=1 --signal=USR1@{slurm['signal_seconds']}"]
    res: dict[str, Any] = {
        "nodes": nodes,
        "cpus_per_task": nproc * slurm["cpus_per_task"],
        "mem_mb": slurm["mem_mb"],
        "runtime": slurm["runtime"],
        "slurm_partition": slurm["partition"],
        "slurm_account": slurm["account"],
        "constraint": slurm["constraint"],
        "qos": slurm["qos"],
    }
    if nodes > 1:
        # The rule's shell runs in the batch step and calls srun itself. The plugin
        # insists on tasks > 1 for MPI-style jobs, so one node runs as a plain job.
        res.update(mpi="srun", tasks=nodes)
    else:
        res["tasks"] = 1
    if gpus:
        res.update(gres=f"gpu:{gpus}", tasks_per_gpu=0)
    res["slurm_extra"] = " ".join(extra)
    return {k: v for k, v in res.items() if v is not None}


def train_resources(cfg: dict[str, Any]) -> dict[str, Callable[[Any], Any]]:
    """The train rule's resources, each a function of the job's ``run`` wildcard.

    A scaling-study point asks for its own nodes and CPUs (:func:`ddppipe.scaling.config_for_run`).
    The base run's request is checked here, so a bad one fails when the Snakefile is read.
    """
    by_run = {cfg["run"]: resources(scaling.config_for_run(cfg, cfg["run"]))}

    def of_run(run: str) -> dict[str, Any]:
        if run not in by_run:
            by_run[run] = resources(scaling.config_for_run(cfg, run))
        return by_run[run]

    return {key: lambda wildcards, key=key: of_run(wildcards.run).get(key) for key in RESOURCE_KEYS}


def job_nodes(job_id: str, run: Any = subprocess.run) -> list[str]:
    """Hosts of a SLURM job, in order, from ``scontrol show job`` (the job's NodeList)."""
    out = run(
        ["scontrol", "-o", "show", "job", str(job_id)],
        capture_output=True, text=True, check=True,
    ).stdout
    return parse_nodelist(out)


def parse_nodelist(scontrol_output: str) -> list[str]:
    """Expanded ``NodeList=`` of one ``scontrol -o show job`` line."""
    for field in scontrol_output.split():
        if field.startswith("NodeList="):
            value = field.split("=", 1)[1]
            if value and value != "(null)":
                return hostlist.expand_hostlist(value)
    raise SlurmRequestError(f"no NodeList in scontrol output: {scontrol_output.strip()[:200]!r}")


def job_id(env: dict[str, str] | None = None) -> str | None:
    """The SLURM job this process runs in, if any."""
    env = os.environ if env is None else env
    return env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
