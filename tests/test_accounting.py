"""sacct's output parsed into per-(job, requeue) records (ddppipe.slurm.accounting)."""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

import pytest

from ddppipe.reports import slurm_accounting
from ddppipe.runstate import failures
from ddppipe.slurm import accounting, scontrol

# Captured from the accounting test cluster (tests/slurm_cluster.py, Slurm 22.05 with
# jobacct_gather/linux sampling every second: JobAcctGatherFrequency=1) by `sacct -j 1,2,3
# --duplicates --parsable2 --noheader
# --format=<accounting.FIELDS>`: job 1 ran one srun step on 2 nodes (--mem=1500, 2 tasks
# busy 3 s holding 80 MB each); job 2 (1 node, --mem-per-cpu=700) was requeued by
# `scontrol requeue` after 6 s, ran again and was cancelled; job 3 (no memory asked: sacct
# shows ReqMem `16?`) exited with status 3.
SACCT = Path(__file__).parent / "data" / "sacct-22.05.txt"


def at(stamp: str) -> float:
    return time.mktime(time.strptime(stamp, "%Y-%m-%dT%H:%M:%S"))


def test_real_sacct_output_gives_a_record_per_job_and_requeue() -> None:
    records = accounting.parse(SACCT.read_text())
    assert [(r.job, r.requeue, r.state) for r in records] == [
        ("1", 0, "COMPLETED"),
        ("2", 0, "REQUEUED"),
        ("2", 1, "CANCELLED by 0"),
        ("3", 0, "FAILED"),
    ]
    first, requeued, again, failed = records
    assert first.nodes == 2 and first.req_mem_mb == 3000.0  # ReqMem: the whole job's
    assert first.total_cpu_s == pytest.approx(4.033)
    assert first.max_rss_mb == pytest.approx(90700 / 1024)  # its step 1.0, the larger task
    assert (first.submit, first.start, first.end) == (
        at("2026-11-23T12:50:53"), at("2026-11-23T12:50:55"), at("2026-11-23T12:50:58"),
    )  # fmt: skip
    assert first.queue_s == 2.0
    assert first.cpus == 2 and first.cpu_hours == pytest.approx(2 * 3 / 3600)
    # the requeue is a record of its own: submitted at the requeue, queued until BeginTime
    assert requeued.end == again.submit == at("2026-11-23T12:51:05")
    assert again.queue_s == 6.0 and again.total_cpu_s == pytest.approx(1.370)
    assert requeued.max_rss_mb == pytest.approx(90648 / 1024)
    assert again.max_rss_mb == pytest.approx(90712 / 1024)
    assert failed.max_rss_mb is None and failed.req_mem_mb is None
    assert failed.total_cpu_s == pytest.approx(0.001)


@pytest.mark.parametrize(
    ("text", "mb"),
    [("90708K", 90708 / 1024), ("2.5G", 2560.0), ("3000M", 3000.0), ("1500Mn", 1500.0),
     ("1T", 1024.0**2), ("0", 0.0), ("", None), ("16?", None), ("Unknown", None)],
)  # fmt: skip
def test_sizes(text: str, mb: float | None) -> None:
    assert accounting.size_mb(text) == (pytest.approx(mb) if mb is not None else None)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("00:05.956", 5.956), ("03:04.567", 184.567), ("01:02:03", 3723.0),
     ("1-02:03:04.5", 93784.5), ("", None), ("INVALID", None)],
)  # fmt: skip
def test_cpu_times(text: str, seconds: float | None) -> None:
    assert accounting.cpu_seconds(text) == (pytest.approx(seconds) if seconds else None)


def test_unknown_times_and_foreign_lines() -> None:
    assert scontrol.timestamp("Unknown") is None and scontrol.timestamp("None") is None
    assert accounting.parse("sacct: error: something\n\n1|COMPLETED\n") == []


def test_no_accounting_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    """No job id to ask about, or sacct without a cluster (no SLURM_CONF here): None."""
    monkeypatch.delenv("SLURM_CONF", raising=False)
    assert accounting.query([]) is None
    assert accounting.query(["local"]) is None
    assert accounting.query(["1"]) is None


# A job whose srun step SLURM's memory limit ended (cgroup ConstrainRAMSpace): the step's and
# the job's state OUT_OF_MEMORY, in the format of the capture above (sacct 22.05, the same
# --format); --mem=10000 on each of 2 nodes, the larger task's MaxRSS 8191000K.
SACCT_OUT_OF_MEMORY = """\
4242|OUT_OF_MEMORY|2026-11-23T13:00:00|2026-11-23T13:00:02|2026-11-23T13:04:10|16:20.500||20000M|16|2
4242.batch|FAILED|2026-11-23T13:00:02|2026-11-23T13:00:02|2026-11-23T13:04:10|00:01.200|20500K||8|1
4242.extern|COMPLETED|2026-11-23T13:00:02|2026-11-23T13:00:02|2026-11-23T13:04:10|00:00.001|1200K||16|2
4242.0|OUT_OF_MEMORY|2026-11-23T13:00:03|2026-11-23T13:00:03|2026-11-23T13:04:09|16:19.299|8191000K||16|2
"""  # fmt: skip
HINT = ("to fit: launch.strategy: fsdp (shards parameters, gradients and optimizer state), a "
        "smaller train.batch_size, or train.activation_checkpointing: true (recomputes each "
        "block's activations in the backward)")  # fmt: skip


def test_a_slot_out_of_memory_in_sacct_names_its_killed_rank() -> None:
    """sacct's OUT_OF_MEMORY (a step's) marks the slot; its rank killed by SIGKILL (recorded by
    the node's agent, the cgroup's counter unread) reads as out of memory, with the limit a
    node and the peak; other slots are left as they are."""
    records = accounting.parse(SACCT_OUT_OF_MEMORY)
    assert [(r.job, r.requeue, r.out_of_memory) for r in records] == [("4242", 0, True)]
    assert records[0].max_rss_mb == pytest.approx(8191000 / 1024)
    assert not any(r.out_of_memory for r in accounting.parse(SACCT.read_text()))
    killed = failures.Failure(
        rank=3, host="cn08", time=1.0, type="SIGKILL", message="killed by SIGKILL", frame=None,
        step=40, epoch=None, restart=0, traceback="", signal="SIGKILL",
    )  # fmt: skip
    slot = {"job": "4242", "restarts": 0, "outcome": "killed by SIGKILL", "exit_status": 137,
            "detail": killed.cause() + " (slots 1 and 2 failed the same way: not retried)",
            "failure": asdict(killed)}  # fmt: skip
    other = {**slot, "job": "4243"}
    named, left = slurm_accounting.out_of_memory_named([slot, other], records)
    assert left == other
    assert named["outcome"] == "out of memory"
    assert named["detail"] == (
        "out of memory on rank 3 (cn08): killed by SLURM's memory limit (SIGKILL; sacct: "
        f"OUT_OF_MEMORY) at the limit of 9.8 GiB host memory, peak 7.8 GiB; {HINT} (slots 1 "
        "and 2 failed the same way: not retried)"
    )
    assert named["failure"]["memory"]["total"] == 10000 * 1024**2
    assert slot["outcome"] == "killed by SIGKILL"  # the history itself is not changed
