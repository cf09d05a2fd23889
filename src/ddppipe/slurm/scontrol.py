"""What SLURM says about a job and its nodes (``scontrol``), and the job this process runs in."""

from __future__ import annotations

import os
import re
import time

import hostlist

from ddppipe.core.errors import UserError
from ddppipe.slurm.runner import run


class ScontrolError(ValueError, UserError):
    """scontrol's answer lacks what was asked for."""


def job_id(env: dict[str, str] | None = None) -> str | None:
    """The SLURM job this process runs in, if any (inside an allocation or not)."""
    env = os.environ if env is None else env
    return env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")


def _scontrol(*args: str) -> str:
    return run(["scontrol", "-o", *args], check=True).stdout


def timestamp(text: str) -> float | None:
    """Unix time of a SLURM time (scontrol's and sacct's local ``2026-11-23T12:42:45``);
    None for Unknown, None or an empty field."""
    try:
        return time.mktime(time.strptime(text.strip(), "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def parse_record(line: str) -> dict[str, str]:
    """``Key=Value`` fields of one ``scontrol -o show`` line (values without spaces)."""
    return dict(m.groups() for m in re.finditer(r"(\w[\w:/]*)=(\S*)", line))


def job_record(job: str) -> dict[str, str]:
    """The job's ``scontrol -o show job`` fields (JobState, NodeList, EndTime, ...)."""
    return parse_record(_scontrol("show", "job", str(job)))


def job_nodes(job: str) -> list[str]:
    """Hosts of a SLURM job, in order, from ``scontrol show job`` (the job's NodeList)."""
    return parse_nodelist(_scontrol("show", "job", str(job)))


def parse_nodelist(scontrol_output: str) -> list[str]:
    """Expanded ``NodeList=`` of one ``scontrol -o show job`` line."""
    value = parse_record(scontrol_output).get("NodeList", "")
    if value and value != "(null)":
        return hostlist.expand_hostlist(value)
    raise ScontrolError(f"no NodeList in scontrol output: {scontrol_output.strip()[:200]!r}")


def node_states(nodes: list[str]) -> dict[str, str]:
    """Each node's ``State`` (e.g. ``MIXED``, ``DOWN+DRAIN``) from ``scontrol show node``."""
    text = _scontrol("show", "node", hostlist.collect_hostlist(nodes))
    records = (parse_record(line) for line in text.splitlines() if line.strip())
    return {r["NodeName"]: r.get("State", "") for r in records if "NodeName" in r}


def requeue(job: str) -> None:
    """``scontrol requeue JOB``: the job goes back to the queue, same id, a fresh time slot."""
    run(["scontrol", "requeue", str(job)], check=True)


def rename(job: str, name: str) -> None:
    """``scontrol update JobId=JOB JobName=NAME``."""
    run(["scontrol", "update", f"JobId={job}", f"JobName={name}"], check=True)


def config() -> str:
    """The cluster's ``scontrol show config`` (``Key = Value`` lines)."""
    return run(["scontrol", "show", "config"], check=True).stdout


def partitions() -> list[dict[str, str]]:
    """Every partition's ``scontrol -o show partition`` fields."""
    records = map(parse_record, _scontrol("show", "partition").splitlines())
    return [r for r in records if "PartitionName" in r]
