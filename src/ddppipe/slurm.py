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
from typing import Any

import hostlist

from ddppipe import config as ddp_config


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
    extra = [f"--ntasks-per-node=1 --signal=USR1@{slurm['signal_seconds']} --requeue"]
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
