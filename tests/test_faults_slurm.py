"""A user's code failing on the session's two-node SLURM cluster (cn07, cn08; one rank a
node): a crash named and not retried forever, a hang continued from the checkpoint.

Both runs wait on SLURM far more than they compute (submissions, status checks, requeues), so
they run side by side (the :func:`runs` fixture starts both; each job takes one of a node's
two CPUs), and each test checks its own.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.slurm_fixtures import SlurmSlot
from tests.test_faults_crash import CRASHING_TASK, failed_line, last_lines
from tests.test_faults_hang import (
    SLEEP_LINE,
    TIMEOUT_S,
    stuck_at,
    stuck_config,
    with_stuck_task,
)  # fmt: skip
from tests.test_slurm import _finish, _result, _start_snakemake, _stop, on_cluster, train_job_ids
from tests.tiny import make_tiny, tiny_config

pytestmark = pytest.mark.slurm


@dataclass
class Run:
    """A snakemake call in the background: its process, output file and working directory."""

    proc: subprocess.Popen
    out: Path
    workdir: Path
    started: float  # time.monotonic() at its start

    def result(self, timeout: float = 400) -> subprocess.CompletedProcess:
        """Wait for it: its output (stdout and stderr in one) as a completed process."""
        return _result(self.proc, _finish(self.proc, self.out, timeout))

    def logs(self, result: subprocess.CompletedProcess) -> str:
        parts = [result.stderr[-6000:]]
        for log in sorted(self.workdir.glob("logs/**/train.log")):
            parts.append(f"==> {log} <==\n{log.read_text(errors='replace')[-3000:]}")
        return "\n".join(parts)


@pytest.fixture(scope="module")
def runs(slurm_slot: SlurmSlot, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """The crash run (all targets) and the hang run (its training), started together."""
    cluster = slurm_slot.cluster()
    root = tmp_path_factory.mktemp("faults-slurm")
    crash_wd = root / "crash"
    (crash_wd / "tasks").mkdir(parents=True)
    (crash_wd / "tasks" / "crashy.py").write_text(CRASHING_TASK)
    crash_cfg = tiny_config(make_tiny(root / "tiny"), epochs=2)
    crash_cfg.update(run="crashy", task="tasks/crashy.py")
    hang_wd = root / "hang"
    with_stuck_task(hang_wd)
    started = time.monotonic()
    found = {
        "crash": Run(*_start_snakemake(
            cluster, crash_wd, on_cluster(crash_cfg, cluster, nodes=2, procs=1)
        ), crash_wd, started),
        "hang": Run(*_start_snakemake(
            cluster, hang_wd, on_cluster(stuck_config("stuck"), cluster, nodes=2, procs=1),
            "results/stuck/train/final.pt",
        ), hang_wd, started),
    }  # fmt: skip
    found["nodes"] = cluster.nodes
    yield found
    for run in (found["crash"], found["hang"]):
        if run.proc.poll() is None:
            _stop(run.proc)


def test_a_crash_on_one_node_is_named_and_not_retried_forever(runs: dict) -> None:
    """Rank 1 (one rank a node) raises in its forward at step 5: the job fails; its retry
    trains into the same crash, and is recorded as final; the last retry refuses in seconds."""
    run = runs["crash"]
    wd = run.workdir
    line = 1 + next(i for i, t in enumerate(CRASHING_TASK.splitlines()) if "raise Runtime" in t)
    result = run.result()
    wall, ended = time.monotonic() - run.started, time.time()
    text = result.stderr
    assert result.returncode != 0, run.logs(result)
    history = json.loads((wd / "results/crashy/state/attempts.json").read_text())
    assert [a["outcome"] for a in history] == ["crashed (exit 1)"] * 2, run.logs(result)
    failure = history[-1]["failure"]
    assert failure["host"] in runs["nodes"] and failure["rank"] == 1, failure
    cause = (f"rank 1 on {failure['host']}: RuntimeError: shape trouble in batch 5 at "
             f"tasks/crashy.py:{line} (in forward), step 5 (epoch 1)")  # fmt: skip
    assert [a["detail"] for a in history] == [
        cause, f"{cause} (slots 1 and 2 failed the same way: not retried)"
    ]  # fmt: skip
    assert failed_line(text) == history[-1]["detail"], last_lines(text)
    # the profile's two retries: the second trained into the same crash, the third refused
    assert len(train_job_ids(result)) == 3, text
    train_log = (wd / "logs/crashy/train.log").read_text()
    refused = f"not training: slots 1 and 2 failed the same way: {cause}"
    assert refused in train_log, train_log[-3000:]
    assert not (wd / "results/crashy/train/final.pt").exists()
    to_end = [a["end"] - a["failure"]["time"] for a in history]
    print(f"(crash on SLURM) snakemake ran {wall:.0f}s; from rank 1's exception to its slot's "
          f"end {to_end[0]:.1f}s, {to_end[1]:.1f}s; from the second exception to snakemake's "
          f"end (the third try refused) {ended - history[1]['failure']['time']:.1f}s; the last "
          f"lines:\n{last_lines(text)}\n(the third try) "
          + re.findall(r".*not training: .*", train_log)[-1])  # fmt: skip


def test_a_hang_on_slurm_continues_from_the_checkpoint(runs: dict) -> None:
    """Rank 1 (on cn08) blocks in the first slot: its stack comes from the other node, the job
    requeues itself and the next slot resumes from the epoch-1 checkpoint and completes."""
    run = runs["hang"]
    wd = run.workdir
    result = run.result()
    wall = time.monotonic() - run.started
    assert result.returncode == 0, run.logs(result)
    history = json.loads((wd / "results/stuck/train/attempts.json").read_text())
    assert [a["outcome"] for a in history] == ["hung", "completed"], history
    frame = f"forward at tasks/stuck.py:{SLEEP_LINE}"
    hung, completed = history
    assert hung["detail"].startswith(f"rank 1 ({hung['nodes'][1]}) in {frame}: "), hung
    assert hung["job"] == completed["job"] and completed["restarts"] == 1, history
    assert completed["resumed_from"] == "ckpt-e0001-s000000", completed
    train_log = (wd / "logs/stuck/train.log").read_text()
    fault_to_outcome = hung["end"] - stuck_at(train_log)
    assert fault_to_outcome < TIMEOUT_S + 8, (fault_to_outcome, train_log[-3000:])
    stacks = (wd / "results/stuck/state/hangs/attempt-1.txt").read_text()
    task = wd / "tasks" / "stuck.py"
    assert f'File "{task.resolve()}", line {SLEEP_LINE}, in forward' in stacks, stacks
    summary = re.findall(r"^ +hung +(.*)$", result.stderr, re.M)  # the summary's line
    assert summary == [f"slot 1: {hung['detail']}"], result.stderr[-3000:]
    print(f"(hang, SLURM) fault to outcome {fault_to_outcome:.1f} s, the run {wall:.1f} s "
          "(next to the crash run); the summary:", summary[0])  # fmt: skip
