"""The workflow on the real two-node SLURM test cluster (tests/slurm_cluster.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
import yaml

from tests.processes import guarded_workers, worker_pids
from tests.slurm_cluster import SlurmCluster
from tests.tiny import REAL_MNIST, REPO, TinyData, make_tiny, real_mnist_sha256, tiny_config

pytestmark = pytest.mark.slurm
PROFILE = str(REPO / "profiles" / "slurm")
T = TypeVar("T")


def two_nodes(cfg: dict[str, Any], gpus: int = 0) -> dict[str, Any]:
    cfg["launch"].update(nnodes=2, nproc_per_node=2, max_restarts=0)
    cfg["slurm"].update(
        gpus_per_node=gpus, cpus_per_task=1, mem_mb=1500, runtime=10, partition="debug"
    )
    return cfg


def snakemake_slurm(
    cluster: SlurmCluster, workdir: Path, cfg: dict[str, Any], *args: str, timeout: float = 600
) -> subprocess.CompletedProcess:
    """``snakemake --profile profiles/slurm`` in ``workdir`` with the cluster's environment."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.yaml").write_text(yaml.safe_dump(cfg))
    env = cluster.environ({"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin:/usr/sbin"})
    return subprocess.run(
        [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(workdir),
         "--configfile", str(workdir / "config.yaml"), "--profile", PROFILE, *args],
        cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip


def logs(workdir: Path, result: subprocess.CompletedProcess) -> str:
    parts = [result.stdout[-4000:], result.stderr[-6000:]]
    for log in sorted(workdir.glob(".snakemake/slurm_logs/**/*.log")):
        parts.append(f"==> {log} <==\n{log.read_text(errors='replace')[-3000:]}")
    for log in sorted(workdir.glob("logs/**/train.log")):
        parts.append(f"==> {log} <==\n{log.read_text(errors='replace')[-3000:]}")
    return "\n".join(parts)


def train_job_ids(result: subprocess.CompletedProcess) -> list[str]:
    pattern = r"submitted with SLURM jobid (\d+) \(log: [^)]*rule_train/"
    return re.findall(pattern, result.stderr)


def provenance(workdir: Path, run: str) -> dict[str, Any]:
    return json.loads((workdir / f"results/{run}/export/provenance.json").read_text())


def test_real_mnist_on_two_nodes(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    cfg = two_nodes(tiny_config(make_tiny(tmp_path / "tiny")))
    cfg["run"] = "mnist2n"
    cfg["data"] = {"mirrors": [REAL_MNIST.as_uri() + "/"], "sha256": real_mnist_sha256()}
    cfg["train"].update(epochs=1, batch_size=256, eval_batch_size=1000)
    started = time.monotonic()
    result = snakemake_slurm(slurm_cluster, tmp_path / "wd", cfg)
    print(f"(a) wall time {time.monotonic() - started:.1f}s")
    assert result.returncode == 0, logs(tmp_path / "wd", result)
    training = provenance(tmp_path / "wd", "mnist2n")["training"]
    assert training["world_size"] >= 2 and set(training["hosts"]) == {"node1", "node2"}
    metrics = json.loads((tmp_path / "wd/results/mnist2n/eval/metrics.json").read_text())
    assert metrics["test_accuracy"] >= 0.95
    train_log = (tmp_path / "wd/logs/mnist2n/train.log").read_text()
    assert "all-reduce ok" in train_log


def test_fake_gpus_per_node(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    tiny = make_tiny(tmp_path / "tiny")
    cfg = two_nodes(tiny_config(tiny), gpus=2)
    result = snakemake_slurm(slurm_cluster, tmp_path / "wd", cfg)
    assert result.returncode == 0, logs(tmp_path / "wd", result)
    assert set(provenance(tmp_path / "wd", "tiny")["training"]["hosts"]) == {"node1", "node2"}
    job = train_job_ids(result)[0]
    record = slurm_cluster.run(["scontrol", "-o", "show", "job", job], check=False).stdout
    # slurmctld keeps finished jobs for MinJobAge (300 s) in the test cluster
    assert "NumNodes=2" in record and "gpu:2" in record, record


def test_sacct_status_mode_with_accounting(
    slurm_accounting_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """The profile with `slurm-status-command: sacct` on a cluster with slurmdbd.

    Without slurmdbd this mode never sees the job finish (so the profile uses squeue).
    """
    cluster = slurm_accounting_cluster
    cfg = two_nodes(tiny_config(make_tiny(tmp_path / "tiny")))
    started = time.monotonic()
    result = snakemake_slurm(cluster, tmp_path / "wd", cfg, FINAL,
                             "--slurm-status-command", "sacct", timeout=400)  # fmt: skip
    print(f"(sacct) wall time {time.monotonic() - started:.1f}s")
    assert result.returncode == 0, logs(tmp_path / "wd", result)
    job = train_job_ids(result)[0]
    out = cluster.run(["sacct", "-j", job, "-X", "-n", "-P", "-o", "JobID,State,NNodes"]).stdout
    assert f"{job}|COMPLETED|2" in out.split(), out


def test_preflight_fails_fast_on_unresolvable_host(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    cfg = two_nodes(tiny_config(make_tiny(tmp_path / "tiny")))
    cfg["slurm"]["rendezvous_host"] = "no-such-host.invalid"
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "preflight.out"
    started = time.monotonic()
    job = slurm_cluster.sbatch(
        "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=2", f"--output={out}",
        f"--chdir={REPO}", "--wrap", f"{sys.executable} -m ddppipe preflight --config {path}",
    )  # fmt: skip
    assert slurm_cluster.wait_job(job, timeout=60) == "FAILED"
    assert time.monotonic() - started < 30
    text = out.read_text()
    assert "cannot resolve the rendezvous host 'no-such-host.invalid'" in text
    assert "node1:" in text and "node2:" in text


def test_impossible_gpu_request_errors(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    cfg = tiny_config(make_tiny(tmp_path / "tiny"))
    cfg["launch"].update(nnodes=2, nproc_per_node=3)
    cfg["train"]["batch_size"] = 60
    cfg["slurm"].update(gpus_per_node=3, partition="debug")
    started = time.monotonic()
    result = snakemake_slurm(slurm_cluster, tmp_path / "wd", cfg, timeout=180)
    assert result.returncode != 0
    # SLURM refuses at submission (here the 3 CPUs of 3 processes/node come first).
    text = result.stdout + result.stderr
    assert "SLURM sbatch failed" in text and "Batch job submission failed" in text, text
    assert time.monotonic() - started < 120


FINAL = "results/tiny/train/final.pt"  # training only: evaluate/export add nothing here


def _poll(
    condition: Callable[[], T | None], proc: subprocess.Popen, timeout: float, what: str, out: Path
) -> T:
    """``condition()`` once it is truthy, polling every 0.2 s while ``proc`` runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if proc.poll() is not None:
            pytest.fail(f"snakemake exited {proc.returncode} before {what}:\n{out.read_text()}")
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"no {what} within {timeout:.0f}s:\n{out.read_text()[-6000:]}")


def _finish(proc: subprocess.Popen, out: Path, timeout: float = 300) -> str:
    """Wait for the background snakemake; its output."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return out.read_text()


def _start_snakemake(
    cluster: SlurmCluster, workdir: Path, cfg: dict[str, Any], *args: str
) -> tuple[subprocess.Popen, Path]:
    """``snakemake --profile profiles/slurm`` in the background; its output goes to a file."""
    workdir.mkdir(parents=True)
    (workdir / "config.yaml").write_text(yaml.safe_dump(cfg))
    env = cluster.environ({"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin:/usr/sbin"})
    out = workdir.parent / f"{workdir.name}.out"
    with out.open("w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(workdir),
             "--configfile", str(workdir / "config.yaml"), "--profile", PROFILE, *args],
            cwd=workdir, env=env, stdout=sink, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
    return proc, out


def _running_job(cluster: SlurmCluster, nodes: int | None = None) -> tuple[str, str] | None:
    """(job id, node list) of the first RUNNING job, of ``nodes`` nodes when given."""
    lines = cluster.run("squeue -h -o '%i %T %D %N'", check=False).stdout.splitlines()
    for job, state, count, nodelist in (line.split() for line in lines):
        if state == "RUNNING" and nodes in (None, int(count)):
            return job, nodelist
    return None


def _model(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=False)["model"]


def test_preemption_resumes_to_identical_weights(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """(d) USR1 to the training step mid-epoch: checkpoint, exit 75, retry, resume, same weights."""
    # 20 steps an epoch: USR1 right after the handlers are in stops at step 10 (mid-epoch).
    tiny: TinyData = make_tiny(tmp_path / "tiny", n_train=320)
    cfg = two_nodes(tiny_config(tiny, epochs=2, batch_size=16))
    world_size = cfg["launch"]["nnodes"] * cfg["launch"]["nproc_per_node"]
    started = time.monotonic()
    wd = tmp_path / "preempted"
    proc, out = _start_snakemake(slurm_cluster, wd, cfg, FINAL)

    # Every rank's training loop has its USR1 handler (earlier, USR1 is ignored).
    _poll(lambda: guarded_workers(wd, world_size), proc, 240,
          "training workers with a SIGUSR1 handler", out)  # fmt: skip
    job, _ = _poll(lambda: _running_job(slurm_cluster, nodes=2), proc, 30, "running job", out)
    slurm_cluster.run(["scancel", "--signal=USR1", job])
    signalled_at = time.monotonic() - started
    text = _finish(proc, out)
    print(f"(d) wall time with preemption {time.monotonic() - started:.1f}s "
          f"(USR1 to job {job} at {signalled_at:.1f}s)")  # fmt: skip
    assert proc.returncode == 0, text
    assert len(re.findall(r"rule train:", text)) >= 2, f"no retry of train after exit 75:\n{text}"
    first = wd / f".snakemake/slurm_logs/rule_train/tiny/{job}.log"
    first_log = first.read_text(errors="replace") if first.exists() else text
    assert "exit status 75" in first_log, (
        f"the signalled attempt did not exit 75:\n{first_log[-3000:]}"
    )
    train_log = (wd / "logs/tiny/train.log").read_text(errors="replace")
    print("(d) resumed:", *re.findall(r"resum\w+ .*", train_log), sep="\n  ")
    resumed = re.search(r"resuming from \S*ckpt-e(\d{4})-s(\d{6})\.pt", train_log)
    assert resumed, f"the retry did not resume from a checkpoint:\n{train_log[-3000:]}"
    assert (int(resumed[1]), int(resumed[2]) > 0) == (0, True), (
        f"expected a mid-epoch checkpoint of epoch 0, resumed from {resumed[0]}"
    )

    # The reference runs on the cluster too: a local torchrun with the same world size
    # can differ in the last bits (gloo over loopback vs. between nodes, thread pools).
    ref = tmp_path / "reference"
    result = snakemake_slurm(slurm_cluster, ref, cfg, FINAL, timeout=300)
    assert result.returncode == 0, logs(ref, result)
    a, b = _model(wd / FINAL), _model(ref / FINAL)
    assert a.keys() == b.keys()
    differ = [key for key in a if not torch.equal(a[key], b[key])]
    assert not differ, f"resumed weights differ from the uninterrupted run in {differ}"


def test_killed_worker_resumes_from_last_checkpoint(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """(e) SIGKILL of one rank's worker in epoch 2: the job fails; the retry resumes at 1."""
    tiny = make_tiny(tmp_path / "tiny", n_train=320)
    cfg = two_nodes(tiny_config(tiny, epochs=3, batch_size=16, checkpoint_every=1))
    started = time.monotonic()
    wd = tmp_path / "killed"
    proc, out = _start_snakemake(slurm_cluster, wd, cfg, FINAL)
    checkpoints = wd / "results/tiny/state/checkpoints"
    _poll(lambda: list(checkpoints.glob("ckpt-e0001-*.pt")), proc, 240,
          "epoch 1 checkpoint", out)  # fmt: skip
    victims = _poll(lambda: worker_pids(wd), proc, 30, "training workers", out)
    os.kill(victims[-1], signal.SIGKILL)
    text = _finish(proc, out)
    print(f"(e) wall time with a killed worker {time.monotonic() - started:.1f}s")
    assert proc.returncode == 0, text
    train_log = (wd / "logs/tiny/train.log").read_text(errors="replace")
    print("(e) resumed:", *re.findall(r"resum\w+ .*", train_log), sep="\n  ")
    epochs = [int(e) for e in re.findall(r"resumed at epoch (\d+)", train_log)]
    assert epochs and min(epochs) >= 1, (
        f"expected a resume at epoch >= 1 after the kill, got {epochs}:\n{train_log[-3000:]}"
    )
    assert (wd / FINAL).exists()


def test_node_failure_requeues_and_resumes_on_the_other_node(
    slurm_accounting_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """(f) The training job's node goes DOWN mid-run: SLURM stops the job (the ranks
    checkpoint on its SIGTERM) and requeues it (same job id) on the other node, where it
    resumes; the plugin waits for it and submits no second job that would train alongside."""
    cluster = slurm_accounting_cluster
    tiny = make_tiny(tmp_path / "tiny", n_train=1920)
    cfg = tiny_config(tiny, epochs=20, batch_size=16, checkpoint_every=1)  # 120 steps an epoch
    cfg["launch"].update(nnodes=1, nproc_per_node=2, max_restarts=0)
    cfg["slurm"].update(cpus_per_task=1, mem_mb=1500, runtime=10, partition="debug")
    started = time.monotonic()
    wd = tmp_path / "node-down"
    proc, out = _start_snakemake(cluster, wd, cfg, FINAL, "--slurm-status-command", "sacct")
    checkpoints = wd / "results/tiny/state/checkpoints"
    _poll(lambda: list(checkpoints.glob("ckpt-e0001-*.pt")), proc, 240,
          "epoch 1 checkpoint", out)  # fmt: skip
    job, node = _poll(lambda: _running_job(cluster), proc, 30, "running job", out)
    # Drained first: the test cluster returns DOWN nodes to service at once (ReturnToService=2),
    # and a drained one stays out of scheduling, as a failed node would.
    for state in ("DRAIN", "DOWN"):
        cluster.run(["scontrol", "update", f"NodeName={node}", f"State={state}", "Reason=test"])
    text = _finish(proc, out, timeout=400)
    print(f"(f) wall time with {node} down: {time.monotonic() - started:.1f}s (job {job})")
    assert proc.returncode == 0, text
    assert re.findall(r"submitted with SLURM jobid (\d+)[^\n]*rule_train", text) == [job], text
    train_log = (wd / "logs/tiny/train.log").read_text(errors="replace")
    print("(f) resumed:", *re.findall(r"resum\w+ .*", train_log), sep="\n  ")
    epochs = [int(e) for e in re.findall(r"resumed at epoch (\d+)", train_log)]
    assert epochs and 1 <= min(epochs) < 20, f"no resume mid-run:\n{train_log[-3000:]}"
    other = ({"node1", "node2"} - {node}).pop()
    hosts = torch.load(wd / FINAL, weights_only=False)["meta"]["hosts"]
    assert set(hosts) == {other}, f"the resumed training ran on {hosts}, not on {other}"
