"""SLURM's own accounting of a run's jobs (``sacct``), to set beside ddppipe's measurements.

One ``sacct --duplicates`` call for every job id of the run gives one record per job and
requeue (a requeued job keeps its id; each slot is a record of its own, with its own Submit,
i.e. the requeue time) and the records of its steps, which carry MaxRSS. Without slurmdbd
(``sacct`` fails, or finds none of the jobs) there is no accounting: :func:`query` gives None.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass

from ddppipe.slurm import scontrol
from ddppipe.slurm.runner import run

FIELDS = ("JobID", "State", "Submit", "Start", "End", "TotalCPU", "MaxRSS", "ReqMem",
          "AllocCPUS", "NNodes")  # fmt: skip
OUT_OF_MEMORY = "OUT_OF_MEMORY"  # the state of a job or step whose memory limit killed a task
TIMEOUT_S = 30  # sacct against an unreachable slurmdbd gives up on its own after ~10 s
NAME = "sacct"  # the summary's name for this accounting
_UNITS = {"": 1 / 1024, "K": 1 / 1024, "M": 1.0, "G": 1024.0, "T": 1024.0**2, "P": 1024.0**3}


@dataclass(frozen=True)
class Record:
    """One slot of a job as SLURM accounted it: the job's line and the largest of its steps'."""

    job: str
    requeue: int  # 0: the job's first slot; n: its n-th requeue
    state: str  # COMPLETED, REQUEUED, FAILED, "CANCELLED by 0", ...
    submit: float | None  # Unix time: the submission, or for a requeue the requeue
    start: float | None
    end: float | None
    total_cpu_s: float | None  # CPU time of every process in the slot's steps
    max_rss_mb: float | None  # the largest task's peak resident memory, over the steps
    req_mem_mb: float | None  # memory requested for the whole job (every node)
    nodes: int
    cpus: int  # CPUs allocated (every node)
    out_of_memory: bool = False  # SLURM's memory limit killed a task: OUT_OF_MEMORY, a step's too

    @property
    def cpu_hours(self) -> float | None:
        """CPU-hours the slot held: its CPUs from start to end."""
        if self.start is None or self.end is None:
            return None
        return self.cpus * (self.end - self.start) / 3600

    @property
    def queue_s(self) -> float | None:
        if self.submit is None or self.start is None:
            return None
        return max(0.0, self.start - self.submit)


def size_mb(text: str) -> float | None:
    """MB of a sacct size (``90708K``, ``2.5G``, ``3000M``; older ReqMem ``1500Mn``)."""
    match = re.fullmatch(r"([\d.]+)([KMGTP]?)[nc]?", text.strip())
    return float(match[1]) * _UNITS[match[2]] if match else None


def cpu_seconds(text: str) -> float | None:
    """Seconds of a sacct duration: ``[D-][HH:]MM:SS[.mmm]``; None when empty or unknown."""
    match = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+(?:\.\d+)?)", text.strip())
    if not match:
        return None
    days, hours, minutes, seconds = (float(g or 0) for g in match.groups())
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


def parse(text: str) -> list[Record]:
    """Records of ``sacct --duplicates --parsable2 --noheader --format=<FIELDS>`` output."""
    slots: list[tuple[dict[str, str], float | None, bool]] = []  # a job line, its steps' MaxRSS
    for line in text.splitlines():  # and whether it or a step ran out of memory
        values = line.split("|")
        if len(values) != len(FIELDS):
            continue
        row = dict(zip(FIELDS, values, strict=True))
        job, _, step = row["JobID"].partition(".")
        peak, oom = size_mb(row["MaxRSS"]), row["State"] == OUT_OF_MEMORY
        if not step:
            slots.append((row, peak, oom))
        elif slots and slots[-1][0]["JobID"] == job:
            head, before, was = slots[-1]
            both = max(before or 0.0, peak) if peak is not None else before
            slots[-1] = (head, both, was or oom)
    records: list[Record] = []
    for row, peak, oom in slots:
        requeue = sum(1 for r in records if r.job == row["JobID"])
        submit, start, end = (scontrol.timestamp(row[key]) for key in ("Submit", "Start", "End"))
        records.append(Record(
            row["JobID"], requeue, row["State"], submit, start, end, cpu_seconds(row["TotalCPU"]),
            peak, size_mb(row["ReqMem"]), int(row["NNodes"] or 0), int(row["AllocCPUS"] or 0),
            oom,
        ))  # fmt: skip
    return records


def query(job_ids: list[str]) -> list[Record] | None:
    """Every slot of these jobs as ``sacct`` reports them; None without SLURM accounting."""
    ids = sorted({j for j in job_ids if j.isdigit()}, key=int)
    if not ids or shutil.which("sacct") is None:
        return None
    command = ["sacct", "-j", ",".join(ids), "--duplicates", "--parsable2", "--noheader",
               f"--format={','.join(FIELDS)}"]  # fmt: skip
    try:
        result = run(command, timeout=TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    records = parse(result.stdout) if result.returncode == 0 else []
    return [r for r in records if r.job in ids] or None
