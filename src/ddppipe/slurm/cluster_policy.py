"""Cluster settings that would make a SLURM run hang or lose work, checked before submitting.

Read from ``scontrol show config`` and ``scontrol show partition``; each finding names the
setting, what it would do to this workflow, and what to do about it. The Snakefile runs
:func:`check_cluster` when the SLURM executor starts, before any job is submitted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ddppipe.core.errors import UserError
from ddppipe.runstate import attempts
from ddppipe.runstate.state import StateDir
from ddppipe.settings.run_spec import RunSpec
from ddppipe.slurm import request as slurm_request
from ddppipe.slurm import scontrol

# The SLURM plugin polls job states as rarely as every 180 s (its back-off cap).
PLUGIN_MAX_POLL_S = 180
# Slack on top of the run's measured stop time (signal to checkpoint written).
STOP_MARGIN_S = 2


class ClusterPolicyError(RuntimeError, UserError):
    """The cluster's settings would hang the workflow or lose work; the message says which."""


@dataclass(frozen=True)
class Finding:
    setting: str
    problem: str
    fix: str

    def __str__(self) -> str:
        return f"{self.setting}: {self.problem}. {self.fix}."


@dataclass(frozen=True)
class Cluster:
    """What the checks need to know of a cluster."""

    config: dict[str, str]  # scontrol show config: Key -> value
    partition: dict[str, str]  # scontrol show partition of the run's partition


def seconds(value: str) -> int | None:
    """``"30 sec"``, ``"5"``, ``"00:01:30"`` as seconds; None when it is none of these."""
    value = value.strip()
    if match := re.fullmatch(r"(\d+)(?: sec)?", value):
        return int(match[1])
    if match := re.fullmatch(r"(\d+):(\d\d):(\d\d)", value):
        return int(match[1]) * 3600 + int(match[2]) * 60 + int(match[3])
    return None


def parse_config(text: str) -> dict[str, str]:
    """``Key = Value`` lines of ``scontrol show config``."""
    pairs = (line.split("=", 1) for line in text.splitlines() if " = " in line)
    return {key.strip(): value.strip() for key, value in pairs}


def read(partition: str | None) -> Cluster:
    """The cluster's config and the partition the run goes to (the default when None)."""
    config = parse_config(scontrol.config())
    records = scontrol.partitions()
    if partition:
        chosen = [r for r in records if r["PartitionName"] == partition]
    else:
        chosen = [r for r in records if r.get("Default") == "YES"]
    if not chosen:
        names = ", ".join(r["PartitionName"] for r in records)
        what = f"partition {partition!r}" if partition else "a default partition"
        raise ClusterPolicyError(
            f"the cluster has no {what} (partitions: {names}); set slurm.partition to one of them"
        )
    return Cluster(config, chosen[0])


def check(
    cluster: Cluster,
    request: slurm_request.Request,
    status_command: str,
    requeue: bool,
    checkpoint_seconds: float | None,
) -> list[Finding]:
    """Findings for a run of ``request``; ``requeue``: the profile's ``slurm-requeue``."""
    return [
        *_requeue_findings(cluster, requeue),
        *_stop_findings(cluster.config, request, checkpoint_seconds),
        *_status_findings(cluster.config, status_command),
    ]


def _requeue_findings(cluster: Cluster, requeue: bool) -> list[Finding]:
    """Jobs that cannot be requeued, or that preemption cancels: the training stops."""
    conf, part = cluster.config, cluster.partition
    name = part.get("PartitionName", "?")
    found: list[Finding] = []
    requeueable = requeue or conf.get("JobRequeue", "1") == "1"
    if not requeueable:
        found.append(Finding(
            "JobRequeue=0 and the profile's slurm-requeue is off",
            "jobs cannot be requeued, so a training longer than one time limit stops at the "
            "first one (its continuation requeues the job), and preemption or a node failure "
            "ends the job",
            "keep `slurm-requeue: true` in profiles/slurm/config.yaml (sbatch --requeue)",
        ))  # fmt: skip
    preempting = conf.get("PreemptType", "preempt/none") != "preempt/none"
    mode = (part.get("PreemptMode") or conf.get("PreemptMode", "OFF")).upper()
    if preempting and "CANCEL" in mode:
        found.append(Finding(
            f"PreemptMode={mode} (partition {name})",
            "a preempted job is cancelled: the SLURM plugin waits forever on its PREEMPTED "
            "state and the training stops",
            "train in a partition whose jobs are requeued or not preempted (slurm.partition), "
            "or ask the administrators for PreemptMode=REQUEUE",
        ))  # fmt: skip
    return found


def _stop_findings(
    conf: dict[str, str], request: slurm_request.Request, checkpoint_seconds: float | None
) -> list[Finding]:
    """A stop that leaves less time than this run's checkpoints take: the slot's work lost."""
    found: list[Finding] = []
    if checkpoint_seconds:
        need = checkpoint_seconds + STOP_MARGIN_S
        kill_wait = seconds(conf.get("KillWait", "30")) or 0
        if kill_wait < need:
            found.append(Finding(
                f"KillWait={kill_wait}s",
                f"a stop without warning (scancel, a draining node) leaves {kill_wait}s "
                f"between SIGTERM and SIGKILL, but this run's checkpoints took up to "
                f"{checkpoint_seconds:.1f}s (+{STOP_MARGIN_S}s to stop): the slot's work since "
                "the last checkpoint is lost",
                "ask for a longer KillWait (preemption adds the partition's GraceTime to it)",
            ))  # fmt: skip
        if request.signal_seconds < need:
            found.append(Finding(
                f"slurm.signal_seconds={request.signal_seconds}",
                f"the time-limit warning leaves less than this run's checkpoint time "
                f"({checkpoint_seconds:.1f}s +{STOP_MARGIN_S}s)",
                f"set slurm.signal_seconds to at least {int(need) + 1}",
            ))  # fmt: skip
    return found


def _status_findings(conf: dict[str, str], status_command: str) -> list[Finding]:
    """A status command that cannot see a job's end: a failure unnoticed, or a wait forever."""
    found: list[Finding] = []
    min_job_age = seconds(conf.get("MinJobAge", "300"))
    if status_command == "squeue" and min_job_age and min_job_age < PLUGIN_MAX_POLL_S:
        found.append(Finding(
            f"MinJobAge={min_job_age}s with status command squeue",
            f"slurmctld forgets a finished job after {min_job_age}s, but the SLURM plugin "
            f"polls as rarely as every {PLUGIN_MAX_POLL_S}s and counts a job it cannot find "
            "as successful: a failed training would go unnoticed",
            "use `--slurm-status-command sacct` (with accounting) or ask for MinJobAge >= 300",
        ))  # fmt: skip
    if status_command == "sacct" and conf.get("AccountingStorageType", "").endswith("/none"):
        found.append(Finding(
            "AccountingStorageType=accounting_storage/none with status command sacct",
            "sacct never sees the jobs, so the SLURM plugin waits forever",
            "set `slurm-status-command: squeue` in the profile",
        ))  # fmt: skip
    return found


def check_cluster(
    spec: RunSpec,
    status_command: str,
    requeue: bool,
    states: list[StateDir],
) -> list[Finding]:
    """Read the cluster and check the config's request; raise ClusterPolicyError on findings
    when ``slurm.cluster_check`` is ``error``, else return them (to be shown as warnings).

    ``states``: the state folders of the runs to train, for their measured checkpoint time.
    """
    request = slurm_request.Request.from_spec(spec)
    measured = [attempts.measured_checkpoint_seconds(d) for d in states]
    checkpoint_seconds = max((m for m in measured if m), default=None)
    cluster = read(request.partition)
    found = check(cluster, request, status_command, requeue, checkpoint_seconds)
    if found and spec.slurm.cluster_check == "error":
        raise ClusterPolicyError(
            "this cluster's settings would make the workflow hang or lose work; nothing was "
            "submitted:\n"
            + "\n".join(f"  - {f}" for f in found)
            + "\nSet slurm.cluster_check: warn to submit anyway."
        )
    return found
