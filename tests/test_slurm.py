"""The workflow on the real two-node SLURM test cluster (tests/slurm_cluster.py)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
import yaml

from ddppipe.runstate import startup
from ddppipe.settings.layout import RunLayout
from ddppipe.slurm import scontrol
from tests import cgroups
from tests.processes import hang_report, processes_in, worker_pids
from tests.slurm_cluster import SlurmCluster
from tests.slurm_fixtures import TRAIN_PARTITION
from tests.tiny import (
    REAL_MNIST,
    REPO,
    TinyData,
    fast_cpu_precision,
    make_tiny,
    real_mnist_sha256,
    tiny_config,
)
from tests.workflow_helpers import stamps

pytestmark = pytest.mark.slurm
PROFILE = str(REPO / "profiles" / "slurm")
T = TypeVar("T")


def partition(cluster: SlurmCluster) -> str | None:
    """The cluster's non-default training partition where it has one, else its default."""
    return TRAIN_PARTITION if TRAIN_PARTITION in cluster.partitions else None


def on_cluster(
    cfg: dict[str, Any], cluster: SlurmCluster, nodes: int = 2, procs: int = 2, gpus: int = 0,
    runtime: int = 10,
) -> dict[str, Any]:  # fmt: skip
    device = "gpu" if gpus else "auto"  # one GPU per process: gpus == procs
    cfg["launch"].update(
        nnodes=nodes, nproc_per_node=gpus or procs, max_restarts=0, cpus_per_proc=1, device=device
    )
    cfg["slurm"].update(
        mem_mb=None if gpus else 1500,
        runtime=runtime,
        partition=partition(cluster),
    )
    return cfg


def two_nodes(cfg: dict[str, Any], cluster: SlurmCluster, gpus: int = 0) -> dict[str, Any]:
    return on_cluster(cfg, cluster, gpus=gpus)


def snakemake_slurm(
    cluster: SlurmCluster,
    workdir: Path,
    cfg: dict[str, Any],
    *args: str,
    timeout: float = 600,
    profile: str = PROFILE,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """``snakemake --profile profiles/slurm`` in ``workdir`` with the cluster's environment
    (and ``env``)."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.yaml").write_text(yaml.safe_dump(cfg))
    path = f"{Path(sys.executable).parent}:/usr/bin:/bin:/usr/sbin"
    env = cluster.environ({"PATH": path, **(env or {})})
    return subprocess.run(
        [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(workdir),
         "--configfile", str(workdir / "config.yaml"), "--profile", profile, *args],
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


def seconds(duration: str) -> float:
    """Seconds of a summary's duration: ``12.5 s``, ``3.1 min``, ``2.0 h``."""
    value, unit = duration.split()
    return float(value) * {"s": 1, "min": 60, "h": 3600}[unit]


def provenance(workdir: Path, run: str) -> dict[str, Any]:
    return json.loads((workdir / f"results/{run}/export/provenance.json").read_text())


@contextlib.contextmanager
def nodes_enforce_memory(cluster: SlurmCluster, mb: int) -> Iterator[dict[str, float]]:
    """Each node's slurmd, and so every job step it starts, in a memory cgroup of ``mb`` MB
    (swap included): a node that enforces a job's --mem as ConstrainRAMSpace does (the test
    cluster has no cgroup plugin of its own); the slurmds moved back after. Yields each
    node's peak in MB, filled in at the end (page cache included)."""
    peaks: dict[str, float] = {}
    with contextlib.ExitStack() as limits:
        made = {}
        for node in cluster.nodes:
            made[node] = limits.enter_context(cgroups.memory_limited(mb * 2**20, node))
            cgroups.enter(made[node], cluster.slurmd_pid(node))
        yield peaks
        peaks.update({node: (cgroups.peak_bytes(cgroup) or 0) / 2**20
                      for node, cgroup in made.items()})  # fmt: skip


def test_real_mnist_on_two_nodes(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """Real MNIST, 2 nodes x 2 ranks, with the default memory request (slurm.mem_mb null), on
    nodes that enforce it: every process of the job on a node (the batch step's Snakemake and
    launcher on the first) in a cgroup of the request's size."""
    cfg = two_nodes(tiny_config(make_tiny(tmp_path / "tiny")), slurm_cluster)
    cfg["run"] = "mnist2n"
    cfg["task_args"] = {"mirrors": [REAL_MNIST.as_uri() + "/"], "sha256": real_mnist_sha256()}
    cfg["train"].update(epochs=1, batch_size=256, eval_batch_size=1000)
    cfg["slurm"]["mem_mb"] = None  # the default request: 3,400 MB a node of 2 CPU processes
    started = time.monotonic()
    counts = tmp_path / "validations"  # tests/count_validations/sitecustomize.py
    counts.mkdir()
    sitecustomize = [str(REPO / "tests" / "count_validations"), os.environ.get("PYTHONPATH", "")]
    counting = {"PYTHONPATH": os.pathsep.join(sitecustomize),
                "DDPPIPE_TEST_VALIDATIONS": str(counts)}  # fmt: skip
    with nodes_enforce_memory(slurm_cluster, 3400) as node_peaks:
        result = snakemake_slurm(slurm_cluster, tmp_path / "wd", cfg, env=counting)
    print(
        f"(a) wall time {time.monotonic() - started:.1f}s; the nodes' cgroups peaked at "
        + ", ".join(f"{node} {mb:,.0f} MB" for node, mb in node_peaks.items())
    )
    assert all(mb > 1024 for mb in node_peaks.values()), node_peaks  # the ranks ran in them
    assert result.returncode == 0, logs(tmp_path / "wd", result)
    # One validation in each process of the slot that reads the run's config (the launcher,
    # each of the 4 ranks), none in the others (the agents); no preflight step of its own.
    slot = [f.read_text().splitlines() for f in counts.iterdir()]
    slot = [c for c in slot if re.search(r"ddppipe\S* (launch|train|agent|preflight)", c[0])]
    assert sorted(len(c) for c in slot) == [1] * 5, slot
    assert [re.search(r"ddppipe\S* (\S+)", c[0])[1] for c in slot].count("train") == 4, slot
    record = provenance(tmp_path / "wd", "mnist2n")
    training = record["training"]
    assert training["world_size"] >= 2 and set(training["hosts"]) == set(slurm_cluster.nodes)
    assert record["train_config"]["preset"] == "fast"  # launch.device auto on SLURM: CPUs
    metrics = json.loads((tmp_path / "wd/results/mnist2n/eval/metrics.json").read_text())
    assert metrics["test_accuracy"] >= 0.95
    train_log = (tmp_path / "wd/logs/mnist2n/train.log").read_text()
    # The checks, by the training's own ranks (one world): gloo on CPUs, the world's and the
    # node pair's bandwidth; their time in the slot's figures.
    figures = re.search(r"checks: .* all-reduce ok \(gloo on cpu\); bus bandwidth (.*)", train_log)
    assert figures, train_log
    assert "preflight-allreduce" not in train_log and "preflight-node" not in train_log
    print("(a) the checks' bus bandwidth:", figures[1])
    a, b = slurm_cluster.nodes
    assert re.search(rf"world \(4 ranks\): [\d.]+ GB/s; {a}<->{b}: [\d.]+ GB/s", figures[1])
    # ... and each node's GEMM peak in the training's precision, all its processes at once,
    # which the slot's attempt record keeps and the summary divides the achieved FLOP/s by.
    precision = fast_cpu_precision()  # the fast preset's on this machine's CPUs
    assert re.search(rf"GEMM peak \({precision}\): {a} [\d,]+ GFLOP/s; {b} [\d,]+ GFLOP/s",
                     figures[1])  # fmt: skip
    (attempt,) = json.loads((tmp_path / "wd/results/mnist2n/train/attempts.json").read_text())
    assert attempt["peak"]["precision"] == precision and set(attempt["peak"]["gflops"]) == {a, b}
    checks_s, startup_s = attempt["efficiency"]["checks_s"], attempt["efficiency"]["startup_s"]
    print(f"(a) the checks took {checks_s:.1f} s of the {startup_s:.1f} s to the first step")
    assert 0.5 < checks_s < startup_s
    # The ranks decided the preset's precision auto on the nodes (not where it was resolved),
    # and the slot keeps what its job asked for (scontrol), which the summary judges against.
    decided = attempt["precision"]
    assert (decided["configured"], decided["trained"]) == ("auto", precision)
    assert training["precision"] == attempt["precision"] and attempt["mem_mb"] == 3400
    # The slot's start in parts from its job's start (ddppipe.runstate.startup): the launcher
    # (no preflight world of its own), each node's agent (no container), its ranks and their
    # checks in the training's own world
    parts = startup.of_attempt(attempt)
    print("(a) start-up:", {name: round(seconds, 2) for name, seconds in parts.items()})
    assert list(parts) == ["job to launcher", "launcher", "launch", "interpreter", "imports",
                           "rendezvous", "process group", "checks", "data", "model",
                           "checkpoint load", "first step"], parts  # fmt: skip
    assert parts["imports"] > 1  # torch, in the agent and in the ranks
    assert parts["checks"] > 0.5  # marked where they end (their figure: checks_s above)
    assert attempt["efficiency"]["startup_s"] == pytest.approx(sum(parts.values())
                                                               - parts["first step"])  # fmt: skip
    summary = result.stderr[result.stderr.rindex("run mnist2n: task ddppipe.tasks.mnist") :]
    print("(a) summary:", summary)
    assert re.search(
        rf"utilisation +\d+% of the peak \([\d,]+ GFLOP/s {precision} GEMM peak, measured", summary
    )
    assert re.search(r"communication +\d+% of a step waits for the all-reduce", summary)
    assert re.search(r"start-up +first step done [\d.]+ s after its job started: job to "
                     r"launcher [\d.]+ s, launcher", summary), summary  # fmt: skip
    # The default request is safe in either precision the CPUs decide: no flag of a peak near
    # or above it (a bf16 run's peak, ~2,150 MB, is flagged as more than it needs: its next
    # job asks for less by itself)
    peak = re.search(r"memory peak ([\d,]+) MB a node of 3,400 MB", summary)
    assert peak and int(peak[1].replace(",", "")) < 0.9 * 3400, summary
    assert "kills the job there" not in summary, summary
    # The job's end noticed within seconds of the slot's end
    # (ddppipe.slurm.executor.status_checks), not at
    # the plugin's next check: 36, 68, 110 s ... after the submission (33 s late, measured).
    slot_end = (tmp_path / "wd/results/mnist2n/state/slot-ended").stat().st_mtime
    (noticed,) = stamps(result.stderr, r"Finished jobid: \d+ \(Rule: train\)")
    print(f"(a) the train job's end noticed {noticed - slot_end:.0f}s after the slot's end")
    assert noticed - slot_end <= 8, logs(tmp_path / "wd", result)


def test_gpus_requested_but_unusable_fail_in_seconds(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """The test cluster hands out GPUs (gres) that no driver backs, as a node with a broken
    driver would: the training's ranks refuse them before they join (no preflight world of its
    own), each node named with what its ranks see, in seconds; nothing trains on the CPU, and
    no node is excluded (every node failed: a problem of the run)."""
    cfg = two_nodes(tiny_config(make_tiny(tmp_path / "tiny")), slurm_cluster, gpus=2)
    wd = tmp_path / "wd"
    result = snakemake_slurm(slurm_cluster, wd, cfg, "--retries", "0", timeout=300)
    assert result.returncode != 0
    text = (wd / "logs/tiny/train.log").read_text()
    for node in slurm_cluster.nodes:
        assert f"preflight: {node}: 2 process(es) need a GPU each and none is usable" in text, text
    assert "CUDA_VISIBLE_DEVICES=" in text and f"torch {torch.__version__}" in text, text
    assert "Fix: no NVIDIA driver is loaded on this node" in text, text
    assert "preflight-allreduce" not in text and "preflight-node" not in text, text
    (attempt,) = json.loads((wd / "results/tiny/state/attempts.json").read_text())
    nodes = ", ".join(slurm_cluster.nodes)
    assert attempt["outcome"] == f"failed its checks ({nodes})", attempt
    assert attempt["start_step"] is None and attempt["efficiency"] is None, "training started"
    assert attempt["detail"].startswith("every node of the slot failed"), attempt
    assert not (wd / "results/tiny/state/excluded-nodes.json").exists()
    resolved = yaml.safe_load((wd / "results/tiny/config.yaml").read_text())
    assert resolved["train"]["preset"] == "gpu"  # launch.device gpu: the GPU recipe
    job = train_job_ids(result)[0]
    record = slurm_cluster.run(["scontrol", "-o", "show", "job", job], check=False).stdout
    # slurmctld keeps finished jobs for MinJobAge (300 s) in the test cluster
    assert "NumNodes=2" in record and "gpu:2" in record, record
    h, m, sec = (int(x) for x in scontrol.parse_record(record)["RunTime"].split(":")[-3:])
    print(f"GPU job refused after {h * 3600 + m * 60 + sec} s of run time")
    assert h * 3600 + m * 60 + sec < 60, record


def test_preflight_fails_fast_on_unresolvable_host(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    cfg = two_nodes(tiny_config(make_tiny(tmp_path / "tiny")), slurm_cluster)
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
    assert all(f"{node}:" in text for node in slurm_cluster.nodes), text


def test_impossible_gpu_request_errors(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    cfg = tiny_config(make_tiny(tmp_path / "tiny"))
    cfg["launch"].update(nnodes=2, nproc_per_node=3, device="gpu")  # 3 GPUs a node: none has
    cfg["train"]["batch_size"] = 60
    cfg["slurm"].update(partition=partition(slurm_cluster))
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
    _stop(proc)
    pytest.fail(f"no {what} within {timeout:.0f}s:\n{out.read_text()[-6000:]}")


def _finish(proc: subprocess.Popen, out: Path, timeout: float = 300) -> str:
    """Wait for the background snakemake; its output."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(proc)
        raise
    return out.read_text()


def _stop(proc: subprocess.Popen) -> None:
    """Stop a background snakemake: SIGINT, on which it cancels its jobs (none is left to
    hold the session's cluster; on SIGTERM it would wait for them), then SIGKILL after a
    minute."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _result(proc: subprocess.Popen, text: str) -> subprocess.CompletedProcess:
    """A finished background snakemake's output (stdout and stderr in one) as a result of
    ``snakemake_slurm``."""
    return subprocess.CompletedProcess(proc.args, proc.returncode, "", text)


def _start_snakemake(
    cluster: SlurmCluster, workdir: Path, cfg: dict[str, Any], *args: str
) -> tuple[subprocess.Popen, Path]:
    """``snakemake --profile profiles/slurm`` in the background; its output goes to a file."""
    workdir.mkdir(parents=True, exist_ok=True)
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


def _running_job(cluster: SlurmCluster, workdir: Path) -> tuple[str, str] | None:
    """(job id, node list) of the RUNNING job of the snakemake run in ``workdir`` (the plugin
    submits with ``-D`` its working directory), not of a run alongside it."""
    lines = cluster.run("squeue -h -o '%i|%T|%N|%Z'", check=False).stdout.splitlines()
    for job, state, nodelist, jobdir in (line.split("|") for line in lines):
        if state == "RUNNING" and Path(jobdir).resolve() == workdir.resolve():
            return job, nodelist
    return None


@contextlib.contextmanager
def _reference_run(
    cluster: SlurmCluster, workdir: Path, cfg: dict[str, Any], *args: str
) -> Iterator[Callable[[], float]]:
    """An uninterrupted run to compare with, in the background while the block runs the
    test's own (the test clusters have room for both jobs). The block calls the function it
    gets to wait for the run and check that it succeeded: seconds from its start to its end.
    If the block fails, the run is stopped."""
    started = time.monotonic()
    proc, out = _start_snakemake(cluster, workdir, cfg, *args)
    ended: list[float] = []

    def wait() -> None:
        proc.wait()
        ended.append(time.monotonic() - started)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()

    def finish() -> float:
        waiter.join(timeout=600)
        assert ended, f"the reference run still runs after 600 s:\n{out.read_text()[-6000:]}"
        assert proc.returncode == 0, logs(workdir, _result(proc, out.read_text()))
        return ended[0]

    try:
        yield finish
    finally:
        if proc.poll() is None:
            _stop(proc)


def _history(workdir: Path, run: str = "tiny") -> list[dict[str, Any]]:
    return json.loads((workdir / f"results/{run}/train/attempts.json").read_text())


# Time-limit slots of 1 minute, the warning 25 s before the end: 35 s into the job, of which
# the job step's Snakemake, the launcher's start-up and preflight and the ranks' start-up take
# 10 s on a fast machine and 25 s on a slow day (2026-11-27: `import torch` 3.4 s). The steps
# of the example task (examples/tasks/tinycnn.py: map-style datasets through the sharded
# DataLoader; 1,600 training samples, 100 steps an epoch of batch 16) take 3 ms on a fast
# machine and ~10 on a slow day; unpaced, a slot trained 10 steps on the slow day (the warning
# came 40 s before the end: 96 slots for 960 steps, past max_continuations) and all 2,400 on
# the AMX machine. So each step is paced TASK_PACE_S longer (a sleep in the task's loss): the
# 800 steps last 34-40 s on any machine, longer than a slot can train (at most ~27 s), so the
# run takes 2 slots on a fast machine and about 4 on a slow day, whatever the node count.
SLOT_MINUTES, SLOT_WARNING_S = 1, 25
TASK_SAMPLES, TASK_STEPS, TASK_EPOCHS = 2000, 100, 8
TASK_PACE_S = 0.04
PACED_LOSS = f"""

import time

_unpaced_loss = loss


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    \"\"\"The example's loss, {TASK_PACE_S * 1000:.0f} ms later (a test's pace).\"\"\"
    time.sleep({TASK_PACE_S})
    return _unpaced_loss(output, target)
"""


def slot_config(tiny: TinyData, cluster: SlurmCluster, nodes: int, runtime: int) -> dict:
    """The paced example task (``tasks/paced.py``: :func:`with_task_file`) on ``nodes`` nodes,
    2 processes in all, in slots of ``runtime`` minutes."""
    cfg = tiny_config(tiny, epochs=TASK_EPOCHS, batch_size=16, checkpoint_every=5)
    cfg["task"], cfg["task_args"] = "tasks/paced.py", {"samples": TASK_SAMPLES}
    cfg["slurm"].update(signal_seconds=SLOT_WARNING_S, max_continuations=30)
    return on_cluster(cfg, cluster, nodes=nodes, procs=2 // nodes, runtime=runtime)


@pytest.fixture(scope="module")
def slot_data(tmp_path_factory: pytest.TempPathFactory) -> TinyData:
    """The tiny MNIST mirror of the slots' configs (the paced task makes its own samples)."""
    return make_tiny(tmp_path_factory.mktemp("slot-data"))


def with_task_file(workdir: Path) -> Path:
    """``workdir`` holding tasks/paced.py: the example task file as a user keeps it, each
    training step TASK_PACE_S longer (a sleep changes no weight)."""
    (workdir / "tasks").mkdir(parents=True, exist_ok=True)
    example = (REPO / "examples" / "tasks" / "tinycnn.py").read_text()
    (workdir / "tasks" / "paced.py").write_text(example + PACED_LOSS)
    return workdir


def _usr1_next_to_reference(
    cluster: SlurmCluster, tmp_path: Path, cfg: dict[str, Any],
    ready: Callable[[Path], object], what: str, *targets: str,
) -> tuple[str, str, float, float]:  # fmt: skip
    """A run in ``tmp_path/signalled`` next to its uninterrupted reference in
    ``tmp_path/reference``: once ``ready(workdir)``, USR1 to its running job's steps (as
    ``scancel --signal=USR1`` does on a preemption notice). (Job id, the run's output, its
    wall time, the reference's.)"""
    wd, ref = tmp_path / "signalled", tmp_path / "reference"
    started = time.monotonic()
    with _reference_run(cluster, ref, cfg, *targets) as reference_run:
        proc, out = _start_snakemake(cluster, wd, cfg, *targets)
        _poll(lambda: ready(wd), proc, 240, what, out)
        job, _ = _poll(lambda: _running_job(cluster, wd), proc, 30, "running job", out)
        cluster.run(["scancel", "--signal=USR1", job])
        text = _finish(proc, out)
        wall = time.monotonic() - started
        assert proc.returncode == 0, text
        return job, text, wall, reference_run()


@pytest.mark.solo
def test_time_limit_slots_on_two_nodes_with_sacct(
    slurm_accounting_cluster: SlurmCluster, slot_data: TinyData, tmp_path: Path
) -> None:
    """A training longer than several time limits completes in one snakemake call: the example
    task file (paced) on node1/node2 in the default partition, the plugin polling sacct
    (requeued states); the same job requeues itself, no retry is used, sacct has a record of
    each slot. Then `ddppipe reproduce` trains it again here in one go (2 ranks on this
    machine, no time limit) from its record: weights bitwise the slots' (identical)."""
    cluster = slurm_accounting_cluster
    cfg = slot_config(slot_data, cluster, 2, SLOT_MINUTES)
    wd = with_task_file(tmp_path / "slots")
    started = time.monotonic()
    proc, out = _start_snakemake(cluster, wd, cfg, FINAL, "results/tiny/export/provenance.json",
                                 "--slurm-status-command", "sacct")  # fmt: skip
    _poll(lambda: (wd / FINAL).exists(), proc, 840, "the trained model", out)  # 2 to 13 slots
    result = _result(proc, _finish(proc, out))
    wall = time.monotonic() - started
    assert result.returncode == 0, logs(wd, result)
    history = _history(wd)
    table = (wd / "logs/tiny/train.log").read_text().split("training complete; attempts:")[-1]
    print(f"(2 nodes, {cfg['task']}) {len(history)} slots in {wall:.0f}s wall:{table}")
    # every slot's log survives, and each slot's ranks made the world's checks
    preflights = re.findall(r"all-reduce ok \(gloo on cpu\); bus bandwidth world \(2 ranks\)",
                            (wd / "logs/tiny/train.log").read_text())  # fmt: skip
    assert len(preflights) == len(history), table
    assert len(train_job_ids(result)) == 1, "a second submission of train: a retry was used"
    assert len(history) >= 2, table
    outcomes = [a["outcome"] for a in history]
    assert outcomes == ["time limit"] * (len(history) - 1) + ["completed"], table
    assert {a["job"] for a in history} == set(train_job_ids(result)), table
    assert [a["restarts"] for a in history] == list(range(len(history))), table
    assert all(a["end_step"] > a["start_step"] for a in history), table
    assert history[-1]["end_step"] == TASK_EPOCHS * TASK_STEPS == 800
    assert all(sorted(a["nodes"]) == ["node1", "node2"] for a in history), table
    # sacct's record of every slot: the job and each of its requeues
    found = f"{len(history)} job record(s) (1 job(s), {len(history) - 1} requeue(s))"
    assert found in result.stderr, result.stderr[-3000:]
    started = time.monotonic()
    code, stdout = _reproduce(wd, "results/tiny", "tiny-reproduced-1")
    print(f"reproduced in {time.monotonic() - started:.0f}s:\n{stdout}")
    assert code == 0, stdout
    assert stdout.splitlines()[-1] == "identical", stdout
    assert "training the reproduction in results/tiny-reproduced-1" in stdout


REPRODUCE_WAIT_S = 300  # the 800 paced steps train in ~50 s here


def _reproduce(workdir: Path, run: str, again: str) -> tuple[int, str]:
    """``ddppipe reproduce RUN`` in ``workdir``: its exit status and output (stdout and
    stderr). Past :data:`REPRODUCE_WAIT_S`, the test fails with what the reproduction
    ``again`` is doing (its processes, its ranks' stacks, its log), then stops it."""
    proc = subprocess.Popen([sys.executable, "-m", "ddppipe", "reproduce", run], cwd=workdir,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=REPRODUCE_WAIT_S)
    except subprocess.TimeoutExpired:
        report = hang_report(workdir, RunLayout.of_root(Path("results") / again))
        for pid, _argv in processes_in(workdir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"reproduce ran past {REPRODUCE_WAIT_S}s:\n{out}\n{report}") from None
    return proc.returncode, out


def test_killed_worker_resumes_from_last_checkpoint(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """(e) SIGKILL of one rank's worker in epoch 2: the job fails; the retry resumes at 1."""
    tiny = make_tiny(tmp_path / "tiny", n_train=320)
    cfg = tiny_config(tiny, epochs=3, batch_size=16, checkpoint_every=1)
    cfg = two_nodes(cfg, slurm_cluster)
    started = time.monotonic()
    wd = tmp_path / "killed"
    proc, out = _start_snakemake(slurm_cluster, wd, cfg, FINAL)
    checkpoints = wd / "results/tiny/state/checkpoints"
    _poll(lambda: list(checkpoints.glob("ckpt-e0001-*/COMMITTED")), proc, 240,
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


def test_script_continues_after_usr1_on_two_nodes(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """The example torchrun script (job API) on cn[07-08]: USR1 to the job's steps mid-run,
    it saves and exits job.STOP, the job requeues itself and the next slot resumes it; the
    weights equal an uninterrupted run's bitwise; evaluate/export summarize what it logged."""
    script = REPO / "examples" / "scripts" / "train_ddp.py"
    cfg = on_cluster(tiny_config(make_tiny(tmp_path / "tiny")), slurm_cluster, nodes=2, procs=1)
    cfg.update(run="script", script=str(script), script_args=["--epochs", "4"])

    def logged_steps(wd: Path) -> bool:
        live = wd / "results/script/state/metrics.jsonl"
        return live.exists() and len(live.read_text().splitlines()) >= 5

    job, _, wall, reference_wall = _usr1_next_to_reference(
        slurm_cluster, tmp_path, cfg, logged_steps, "logged steps"
    )
    wd, ref = tmp_path / "signalled", tmp_path / "reference"
    print(f"(script, USR1) wall time {wall:.1f}s, the reference alongside {reference_wall:.1f}s")
    history = _history(wd, "script")
    assert [a["outcome"] for a in history] == ["stopped on SIGUSR1", "completed"], history
    assert {a["job"] for a in history} == {job} and len(history[0]["nodes"]) == 2, history
    a = torch.load(wd / "results/script/export/outputs/model.pt", weights_only=True)
    b = torch.load(ref / "results/script/export/outputs/model.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    summary = json.loads((wd / "results/script/eval/metrics.json").read_text())
    assert (
        summary["step"]
        == json.loads((ref / "results/script/eval/metrics.json").read_text())["step"]
    )
    record = provenance(wd, "script")
    assert record["script"]["path"] == str(script) and record["script"]["args"] == ["--epochs", "4"]
    assert "model.pt" in record["outputs_sha256"]


# -- on the accounting cluster: the session's clusters switch only when a test needs the
# other one (tests/slurm_fixtures.py), so these run together. (A node lost mid-run: tests/
# test_slurm_spare_nodes.py, on a cluster of its own.)


def test_sacct_status_mode_with_accounting(
    slurm_accounting_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """The profile with `slurm-status-command: sacct` on a cluster with slurmdbd.

    Without slurmdbd this mode never sees the job finish (so the profile uses squeue).
    """
    cluster = slurm_accounting_cluster
    cfg = two_nodes(tiny_config(make_tiny(tmp_path / "tiny")), cluster)
    started = time.monotonic()
    result = snakemake_slurm(cluster, tmp_path / "wd", cfg, FINAL,
                             "--slurm-status-command", "sacct", timeout=400)  # fmt: skip
    print(f"(sacct) wall time {time.monotonic() - started:.1f}s")
    assert result.returncode == 0, logs(tmp_path / "wd", result)
    job = train_job_ids(result)[0]
    out = cluster.run(["sacct", "-j", job, "-X", "-n", "-P", "-o", "JobID,State,NNodes"]).stdout
    assert f"{job}|COMPLETED|2" in out.split(), out
    # The summary printed after the run joins sacct's figures of the job to the ranks' own.
    sacct = re.search(
        r"sacct +1 job record\(s\) \(1 job\(s\), 0 requeue\(s\)\): 1 COMPLETED; "
        r"[\d.]+ CPU-hours allocated; TotalCPU "
        r"([\d.]+ \w+) \(the ranks' own ([\d.]+ \w+)\); MaxRSS ([\d,]+) MB a task of ReqMem "
        r"1,500 MB a node \(own peak ([\d,]+) MB a node\); queued [\d.]+ \w+ \(own [\d.]+ \w+\)",
        result.stderr,
    )  # fmt: skip
    assert sacct, result.stderr[-3000:]
    print("(sacct) summary:", sacct[0])
    total_cpu, own_cpu = (seconds(text) for text in sacct.groups()[:2])
    max_rss, own_peak = (float(text.replace(",", "")) for text in sacct.groups()[2:])
    assert total_cpu >= own_cpu > 0  # sacct also counts the launcher, torchrun, the preflight
    # sacct: the largest task (a node's torchrun and its ranks), sampled every 30 s; own: the
    # node's ranks' and their agent's peaks, the libraries they share counted once
    assert max_rss > 100 and own_peak > 100
    assert re.search(r"wall +[\d.]+ \w+ from the first submission to the last slot's end",
                     result.stderr), result.stderr[-3000:]  # fmt: skip
