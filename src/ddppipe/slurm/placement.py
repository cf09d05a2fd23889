"""A training step placed on chosen nodes of a held allocation: a packed sweep's multi-node
trial, on one slot of each of its nodes.

The allocation's node workers choose the slots (:mod:`ddppipe.packing.gang`); the trial's
launcher runs its srun step on those nodes (``--nodelist``, and ``--overlap``: the workers'
own step holds the nodes' CPUs), and each node's agent keeps its processes to its slot's CPUs
and GPUs (:meth:`Placement.apply`). The trial's environment carries it
(:data:`ddppipe.core.env_names.PLACEMENT`).
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping, MutableMapping
from dataclasses import asdict, dataclass

from ddppipe.core import env_names


@dataclass(frozen=True)
class Placement:
    """The nodes of a step inside allocation ``job``, and its slot's CPUs and GPUs on each."""

    job: str
    nodes: list[str]
    cpus: dict[str, list[int]]
    gpus: dict[str, list[str]]

    def to_env(self) -> dict[str, str]:
        """The trial's environment variables: the placement, and its allocation's job."""
        return {env_names.PLACEMENT: json.dumps(asdict(self)), "SLURM_JOB_ID": self.job}

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Placement | None:
        """The placement this process runs under, None when it is no placed step."""
        text = env.get(env_names.PLACEMENT)
        if not text:
            return None
        found = json.loads(text)
        return cls(found["job"], found["nodes"], found["cpus"], found["gpus"])

    def srun_options(self) -> list[str]:
        """srun's options for the step: its nodes, sharing them with the workers' step."""
        return [f"--nodelist={','.join(self.nodes)}", "--overlap"]

    def apply(self, env: MutableMapping[str, str], node: str | None = None) -> None:
        """(A node's agent) Keep this process, and the ranks it starts, to the slot's CPUs
        and GPUs on ``node`` (this node: SLURM's name for it, else the host name)."""
        node = node or env.get("SLURMD_NODENAME") or socket.gethostname()
        if node not in self.cpus:
            raise ValueError(f"node {node} is none of the placement's {', '.join(self.nodes)}")
        os.sched_setaffinity(0, self.cpus[node])
        if self.gpus.get(node):
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.gpus[node])
