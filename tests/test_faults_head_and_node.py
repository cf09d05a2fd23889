"""A bad node and a lost head on a SLURM cluster of three nodes (gpu1, gpu2, gpu3), a 2-node run.

gpu2 does not see the shared filesystem (an empty tmpfs over the working directory in its
mount namespace, as a node whose NFS mount failed): the first training job, on gpu[1-2],
fails its preflight there and gpu2 is excluded from the next slot, which trains on gpu1 and
gpu3. Mid-training the submitting snakemake's process group gets SIGHUP (a dropped login
session); started again after ``--unlock``, it attaches to the running job instead of
submitting another, waits for it and builds every target.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from tests.slurm_cluster import SlurmCluster
from tests.slurm_fixtures import SlurmSlot
from tests.test_slurm import on_cluster
from tests.tiny import REPO, default_config, points_task

pytestmark = pytest.mark.slurm
PROFILE = str(REPO / "profiles" / "slurm")
NODES = ("gpu1", "gpu2", "gpu3")
BAD = "gpu2"

# A user's own task: 4 classes of noisy 64-dimensional points, an MLP; the training waits while
# `hold` exists in the working directory (the test's).
TASK = points_task(dim=64, hidden=256, noise=1.5)


def start_head(cluster: SlurmCluster, wd: Path, out: Path, *args: str) -> subprocess.Popen:
    """``snakemake --profile profiles/slurm`` in ``wd`` in a session of its own (as a login
    shell's: SIGHUP ends it, also where the tests run under nohup), its output to ``out``."""
    env = cluster.environ({"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin:/usr/sbin"})
    with out.open("w") as sink:
        return subprocess.Popen(
            [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(wd),
             "--configfile", str(wd / "config.yaml"), "--profile", PROFILE, *args],
            cwd=wd, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL),
        )  # fmt: skip


def wait_for(
    condition: Any, proc: subprocess.Popen | None, out: Path, timeout: float, what: str
) -> Any:
    """``condition()`` once truthy, polled while ``proc`` (a head in this shell, if any) runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := condition():
            return value
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"snakemake exited {proc.returncode} before {what}:\n{out.read_text()}")
        time.sleep(0.2)
    if proc is not None:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
    text = out.read_text() if out.exists() else ""
    pytest.fail(f"no {what} within {timeout:.0f}s:\n{text[-6000:]}")


def finish(proc: subprocess.Popen, out: Path, timeout: float) -> str:
    """Wait for a head; its output. On timeout, SIGINT (it cancels its jobs) and fail."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
        pytest.fail(f"snakemake still runs after {timeout:.0f}s:\n{out.read_text()[-6000:]}")
    return out.read_text()


def train_jobs(cluster: SlurmCluster) -> list[tuple[str, str, str]]:
    """(job id, state, nodes) of every training job slurmctld knows (MinJobAge 300 s)."""
    out = cluster.run("squeue -h -t all -o '%i|%T|%N|%k'").stdout
    rows = [line.split("|") for line in out.splitlines()]
    jobs = [(j, s, n) for j, s, n, comment in rows if comment.startswith("rule_train")]
    return sorted(jobs, key=lambda row: int(row[0]))


def head_job_state(cluster: SlurmCluster, job: str) -> str | None:
    """The head job's state once it has ended; None while it is queued or runs."""
    state = cluster.run(["squeue", "-h", "-t", "all", "-j", job, "-o", "%T"]).stdout.strip()
    return state if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT") else None


def test_bad_node_excluded_then_restarted_heads_attach(
    slurm_slot: SlurmSlot, tmp_path: Path
) -> None:
    wd = tmp_path / "wd"
    wd.mkdir()
    (wd / "points.py").write_text(TASK)
    cfg = default_config()
    cfg.update(run="points", task="points.py", task_args={"samples": 20000})
    cfg["train"].update(epochs=18, batch_size=32, eval_batch_size=500, checkpoint_every=1)
    cfg["launch"]["hang_timeout_s"] = 900  # the training is held (wd/hold) while heads come
    with slurm_slot.suspended(), slurm_slot.new_cluster("slurm-gpu3", nodes=NODES) as cluster:
        on_cluster(cfg, cluster, nodes=2, procs=1)
        (wd / "config.yaml").write_text(yaml.safe_dump(cfg))
        # gpu2's view of the working directory: empty, as with a shared filesystem not mounted
        cluster.run(["mount", "-t", "tmpfs", "tmpfs", str(wd)], node=BAD)
        started = time.monotonic()
        first = start_head(cluster, wd, tmp_path / "first.out")
        checkpoints = wd / "results/points/state/checkpoints"
        wait_for(lambda: list(checkpoints.glob("ckpt-e0001-*/COMMITTED")), first,
                 tmp_path / "first.out", 240, "the first epoch's checkpoint")  # fmt: skip
        (wd / "hold").touch()  # the training waits until the head job has attached (3)
        jobs = train_jobs(cluster)
        assert [(s, n) for _, s, n in jobs] == [("FAILED", "gpu[1-2]"), ("RUNNING", "gpu[1,3]")]
        cluster.run(["umount", str(wd)], node=BAD)  # repaired: the head job may run there
        os.killpg(first.pid, signal.SIGHUP)  # the login session drops
        first.wait(timeout=30)
        killed = time.monotonic()
        print(f"(1) head killed (SIGHUP) {killed - started:.1f}s after its start; jobs {jobs}")
        # (2) the standard restart in a login shell: --unlock, then the same command
        unlock = start_head(cluster, wd, tmp_path / "unlock.out", "--unlock")
        assert unlock.wait(timeout=120) == 0, (tmp_path / "unlock.out").read_text()
        second = start_head(cluster, wd, tmp_path / "second.out")
        attach = f"ddppipe: attaching to SLURM job {jobs[1][0]} (RUNNING) of rule train"
        wait_for(lambda: attach in (tmp_path / "second.out").read_text(), second,
                 tmp_path / "second.out", 120, "the second head attaching")  # fmt: skip
        attached = time.monotonic()
        os.killpg(second.pid, signal.SIGKILL)  # lost again
        second.wait(timeout=30)
        print(f"(2) restarted head attached {attached - killed:.1f}s after the kill; SIGKILL")
        # (3) the documented head job, from the working directory
        args = ["-s", str(REPO / "Snakefile"), "--configfile", "config.yaml", "--profile", PROFILE]
        submit = [sys.executable, "-m", "ddppipe", "submit", "--time", "10", "--", *args]
        env = cluster.environ({"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"})
        submitted = subprocess.run(submit, cwd=wd, env=env, capture_output=True, text=True,
                                   timeout=60, check=False)  # fmt: skip
        assert submitted.returncode == 0, submitted.stderr
        print("(3)", submitted.stdout.strip())
        head_job = re.search(r"submitted head job (\d+)", submitted.stdout)[1]
        again = subprocess.run(submit, cwd=wd, env=env, capture_output=True, text=True,
                               timeout=60, check=False)  # fmt: skip
        print("(3) again:", again.stderr.strip())
        assert again.returncode == 2 and f"head job {head_job} of {wd} is queued or running" in (
            again.stderr
        )
        head_log = wd / f"logs/head/{head_job}.log"
        wait_for(lambda: head_log.exists() and attach in head_log.read_text(), None,
                 head_log, 120, "the head job attaching")  # fmt: skip
        head_attached = time.monotonic()
        (wd / "hold").unlink()  # the training goes on
        # (4) its time-limit warning, as SLURM sends it (B:USR1): it requeues itself
        cluster.run(["scancel", "--batch", "--signal=USR1", head_job])
        deadline = time.monotonic() + 300
        while (state := head_job_state(cluster, head_job)) is None:
            assert time.monotonic() < deadline, cluster.run(f"scontrol show job {head_job}").stdout
            time.sleep(0.5)
        ended = time.monotonic()
        text = head_log.read_text()
        after = train_jobs(cluster)
        record = cluster.run(["scontrol", "-o", "show", "job", head_job]).stdout
    print(
        f"(3) head job {head_job} attached {head_attached - attached:.1f}s after the "
        f"second kill; (4) USR1, requeued, {state} {ended - head_attached:.1f}s later"
    )
    print(*re.findall(r".*ddppipe head: .*", text), sep="\n")
    assert "Restarts=1 " in record, record
    assert text.count(attach) == 2, text[-6000:]  # its first start, and its start after requeue
    assert f"ddppipe head: time limit of head job {head_job} near" in text
    first_text = (tmp_path / "first.out").read_text()
    print(*re.findall(r".*ddppipe: (?:attaching|excluding).*", first_text + text), sep="\n")
    assert state == "COMPLETED", text[-6000:]
    # one job after the exclusion; no head after the first submitted any
    assert after == [(jobs[0][0], "FAILED", "gpu[1-2]"), (jobs[1][0], "COMPLETED", "gpu[1,3]")]
    assert "submitted with SLURM jobid" not in text + (tmp_path / "second.out").read_text()
    assert f"ddppipe: excluding {BAD} from SLURM submissions" in first_text
    history = json.loads((wd / "results/points/train/attempts.json").read_text())
    print(*(f"{a['number']} {a['job']} {a['nodes']} {a['outcome']}: {a['detail']}"
            for a in history), sep="\n")  # fmt: skip
    assert [(a["job"], a["nodes"], a["outcome"]) for a in history] == [
        (jobs[0][0], ["gpu1", "gpu2"], "bad node gpu2"),
        (jobs[1][0], ["gpu1", "gpu3"], "completed"),
    ]
    assert "excluded from the next slot" in history[0]["detail"]
    assert json.loads((wd / "results/points/state/excluded-nodes.json").read_text()) == [BAD]
    train_log = (wd / "logs/points/train.log").read_text()
    assert f"{BAD}: does not see the run's state folder" in train_log, train_log[-3000:]
    final = torch.load(wd / "results/points/train/final.pt", weights_only=False)
    assert set(final["meta"]["hosts"]) == {"gpu1", "gpu3"}
    assert (wd / "results/points/export/model.pt").exists()
    metrics = json.loads((wd / "results/points/eval/metrics.json").read_text())
    assert metrics["test_accuracy"] > 0.9, metrics
