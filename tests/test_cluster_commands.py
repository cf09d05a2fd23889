"""ddppipe's SLURM command lines (sbatch, squeue, scontrol, scancel), each run through the one
runner (ddppipe.slurm.runner), checked against a fake of it: no cluster needed."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest

from ddppipe.core import atomic
from ddppipe.packing import allocation
from ddppipe.packing.pool import Pool
from ddppipe.slurm import head, sbatch, scancel, scontrol, squeue


class FakeRun:
    """Records each command; answers with ``stdout``, ``returncode`` and ``stderr``."""

    def __init__(self, stdout: str = "", returncode: int = 0, stderr: str = "") -> None:
        self.calls: list[tuple[list[str], float, bool]] = []
        self.answer = (stdout, returncode, stderr)

    def __call__(
        self, argv: list[str], timeout: float = 60.0, check: bool = False
    ) -> subprocess.CompletedProcess[str]:
        self.calls.append((list(argv), timeout, check))
        stdout, code, stderr = self.answer
        if check and code:
            raise subprocess.CalledProcessError(code, argv, stdout, stderr)
        return subprocess.CompletedProcess(argv, code, stdout, stderr)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeRun:
    run = FakeRun()
    for module in (sbatch, scancel, scontrol, squeue):
        monkeypatch.setattr(module, "run", run)
    monkeypatch.setattr(squeue, "_mine", {})
    monkeypatch.setattr(squeue.getpass, "getuser", lambda: "me")
    return run


def test_sbatch_line_keeps_the_options_order_and_leaves_out_none() -> None:
    options: dict[str, sbatch.Option] = {
        "--job-name": "j", "--requeue": True, "--account": None, "--hold": False, "--time": "5",
    }  # fmt: skip
    assert sbatch.argv(options, "exec true") == [
        "sbatch", "--parsable", "--job-name=j", "--requeue", "--time=5", "--wrap", "exec true",
    ]  # fmt: skip


def test_sbatch_submission_gives_the_job_id_or_its_refusal(fake: FakeRun) -> None:
    fake.answer = ("4242;cluster\n", 0, "")
    assert sbatch.submit(["sbatch", "--parsable", "--wrap", "true"], timeout=120) == "4242"
    assert fake.calls == [(["sbatch", "--parsable", "--wrap", "true"], 120, False)]
    fake.answer = ("", 1, "sbatch: error: Invalid partition name specified\n")
    with pytest.raises(sbatch.SbatchError, match=r"^sbatch: error: Invalid partition name"):
        sbatch.submit(["sbatch", "--parsable", "--wrap", "true"], timeout=60)


def test_this_users_queue_is_read_once_for_a_few_seconds(fake: FakeRun) -> None:
    fake.answer = ("5|RUNNING|ddppipe-head||/wd\n6|PENDING|r|rule_train|/wd\nbad line\n", 0, "")
    first = squeue.mine()
    assert first == [
        squeue.Queued("5", "RUNNING", "ddppipe-head", "", Path("/wd")),
        squeue.Queued("6", "PENDING", "r", "rule_train", Path("/wd")),
    ]
    assert squeue.mine() == first
    assert fake.calls == [(["squeue", "-h", "-u", "me", "-o", "%i|%T|%j|%k|%Z"], 60.0, True)]
    squeue.mine(max_age_s=-1)
    assert len(fake.calls) == 2


def test_steps_and_states_of_jobs(fake: FakeRun) -> None:
    fake.answer = ("17.0\n17.batch\n17.12\n170.1\n", 0, "")
    assert squeue.steps("17") == ["17.0", "17.12"]
    fake.answer = ("17 RUNNING\n18 PENDING\n\n", 0, "")
    assert squeue.states(["17", "18"]) == {"17": "RUNNING", "18": "PENDING"}
    assert [c[:2] for c in fake.calls] == [
        (["squeue", "-h", "-s", "-j", "17", "-o", "%i"], 30.0),
        (["squeue", "--noheader", "--format=%i %T", "--jobs=17,18"], 60.0),
    ]


def test_scancel_signals_a_step_by_number_and_says_why_it_failed(fake: FakeRun) -> None:
    assert scancel.send("17.0", signal.SIGUSR1) is None
    fake.answer = ("", 1, "scancel: error: Invalid job id 17.9\n")
    assert scancel.send("17.9", signal.SIGKILL) == "scancel: error: Invalid job id 17.9"
    assert [c[:2] for c in fake.calls] == [
        (["scancel", "--signal=10", "17.0"], 30.0),
        (["scancel", "--signal=9", "17.9"], 30.0),
    ]


def test_scontrol_calls(fake: FakeRun) -> None:
    fake.answer = ("PartitionName=gpu Default=YES\nPartitionName=cpu\n", 0, "")
    assert scontrol.partitions() == [
        {"PartitionName": "gpu", "Default": "YES"}, {"PartitionName": "cpu"},
    ]  # fmt: skip
    scontrol.rename("17", "run-uuid")
    scontrol.requeue("17")
    assert fake.calls == [
        (["scontrol", "-o", "show", "partition"], 60.0, True),
        (["scontrol", "update", "JobId=17", "JobName=run-uuid"], 60.0, True),
        (["scontrol", "requeue", "17"], 60.0, True),
    ]


def test_head_submission_is_refused_while_a_head_of_the_directory_lives(
    fake: FakeRun, tmp_path: Path
) -> None:
    fake.answer = (f"5|RUNNING|ddppipe-head||{tmp_path}/.\n6|RUNNING|ddppipe-head||/else\n", 0, "")
    with pytest.raises(head.HeadError, match=r"^head job 5 of .* is queued or running: two"):
        head.submit(["-n"], "10", workdir=tmp_path)
    assert len(fake.calls) == 1  # squeue only: nothing submitted


def test_held_allocations_are_the_live_ones_squeue_shows(fake: FakeRun, tmp_path: Path) -> None:
    pool = Pool(tmp_path / "pack")
    for job in ("5", "6", "7"):
        atomic.write_json(pool.allocations / f"{job}.json", {"job": job})
    fake.answer = ("5 RUNNING\n6 COMPLETING\n", 0, "")
    assert allocation.held(pool) == ["5"]
    assert fake.calls == [(["squeue", "--noheader", "--format=%i %T", "--jobs=5,6,7"], 60.0, False)]
