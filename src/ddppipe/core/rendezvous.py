"""Hosts and ports of a SLURM job: its step's node list, the first host, a port per job."""

from __future__ import annotations

from collections.abc import Mapping

import hostlist

from ddppipe.core.errors import UserError

# SLURM jobs derive their port from the job id, so two jobs sharing a node never collide.
SLURM_PORT_BASE = 15000
SLURM_PORT_SPAN = 20000


class NodelistError(RuntimeError, UserError):
    """A SLURM node list cannot be read; the message quotes it."""


def step_nodelist(env: Mapping[str, str]) -> str | None:
    """The nodes of this SLURM step (a step may use a subset of its job's nodes)."""
    for key in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        if env.get(key):
            return env[key]
    return None


def first_host(nodelist: str) -> str:
    """First host of a SLURM node list such as ``node[1-4,7],gpu01``."""
    try:
        hosts = hostlist.expand_hostlist(nodelist)
    except hostlist.BadHostlist as e:
        raise NodelistError(f"cannot parse SLURM node list {nodelist!r}: {e}") from e
    if not hosts:
        raise NodelistError(f"SLURM node list {nodelist!r} is empty")
    return hosts[0]


def job_port(job_id: int) -> int:
    """A rendezvous port derived from a SLURM job id (distinct for jobs sharing a node)."""
    return SLURM_PORT_BASE + job_id % SLURM_PORT_SPAN


def step_port(job_id: int, step_id: int) -> int:
    """A rendezvous port of one step of a job: two steps running at once on one node (a packed
    allocation's multi-node trials) get their own; step 0 (or none) gets the job's port."""
    return SLURM_PORT_BASE + (job_id + 1009 * step_id) % SLURM_PORT_SPAN
