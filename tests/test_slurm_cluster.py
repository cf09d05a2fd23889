"""Smoke tests of the two-node SLURM test cluster: what the DDP workflow relies on."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.slurm_cluster import (
    BRIDGE,
    HOSTS_FILE,
    HOSTS_MARKER,
    NODE_ADDRS,
    STATE_FILE,
    SlurmCluster,
    netns_pids,
)
from tests.slurm_fixtures import SESSION_NODES, SlurmSlot

pytestmark = pytest.mark.slurm

RENDEZVOUS = """\
import os, socket, sys, time

master, port = sys.argv[1], int(sys.argv[2])
me = socket.gethostname()
if int(os.environ["SLURM_PROCID"]) == 0:
    # Bind to this node's own address, as torch's c10d store does on MASTER_ADDR.
    with socket.create_server((socket.gethostbyname(me), port)) as server:
        server.settimeout(30)
        conn, peer = server.accept()
        with conn:
            print(f"{me} accepted {peer[0]}: {conn.recv(100).decode()}", flush=True)
else:
    deadline = time.monotonic() + 30
    while True:
        try:
            with socket.create_connection((master, port), timeout=2) as conn:
                conn.sendall(f"hello from {me}".encode())
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
"""

RENDEZVOUS_JOB = """\
#!/bin/bash
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
srun python3 {script} "$MASTER_ADDR" 29500
"""

# Traps USR1 like a checkpointing trainer: save, then requeue itself.
REQUEUE_ON_USR1_JOB = """\
#!/bin/bash
restarts=${{SLURM_RESTART_COUNT:-0}}
trap 'echo "USR1 restart=$restarts"; scontrol requeue "$SLURM_JOB_ID"; exit 0' USR1
echo "started restart=$restarts on $(hostname)"
if [ "$restarts" -ge 1 ]; then exit 0; fi
for _ in $(seq {seconds}); do sleep 1 & wait $!; done
echo "never signalled"
exit 1
"""


def wait_for_text(path: Path, text: str, timeout: float = 30.0) -> str:
    """Wait until ``path`` exists and contains ``text``; return its content."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        content = path.read_text() if path.exists() else ""
        if text in content:
            return content
        time.sleep(0.1)
    raise AssertionError(f"{text!r} not in {path} after {timeout}s: {content!r}")


# First: the accounting cluster still runs after the last tests of tests/test_slurm.py
# (the session's clusters switch only when a test needs the other one).
def test_sacct_shows_completed_job(slurm_accounting_cluster: SlurmCluster) -> None:
    cluster = slurm_accounting_cluster
    job = cluster.sbatch("--output=/dev/null", "--wrap", "hostname")
    assert cluster.wait_job(job) == "COMPLETED"
    deadline = time.monotonic() + 30
    states: list[str] = []
    while time.monotonic() < deadline:
        out = cluster.run(["sacct", "-j", str(job), "-X", "-n", "-P", "-o", "JobID,State"])
        states = out.stdout.split()
        if f"{job}|COMPLETED" in states:
            return
        time.sleep(0.5)
    raise AssertionError(f"sacct never showed job {job} COMPLETED: {states}")


def test_srun_spans_both_nodes(slurm_cluster: SlurmCluster) -> None:
    out = slurm_cluster.run("srun -N2 --ntasks-per-node=1 hostname", timeout=30).stdout
    assert sorted(out.split()) == sorted(slurm_cluster.nodes)


def test_gpu_request_sets_cuda_visible_devices(slurm_cluster: SlurmCluster) -> None:
    cmd = "srun -N1 --gres=gpu:2 bash -c 'echo $CUDA_VISIBLE_DEVICES'"
    devices = slurm_cluster.run(cmd, timeout=30).stdout.strip()
    assert len(devices.split(",")) == 2, devices


def test_impossible_request_fails_at_submit(slurm_cluster: SlurmCluster) -> None:
    started = time.monotonic()
    result = slurm_cluster.run(
        ["sbatch", "-N2", "--gres=gpu:3", "--wrap", "true"], check=False, timeout=30
    )
    assert result.returncode != 0
    assert "Requested node configuration is not available" in result.stderr
    assert time.monotonic() - started < 10


def test_a_memory_request_above_the_nodes_is_refused_and_sinfo_says_theirs(
    slurm_cluster: SlurmCluster,
) -> None:
    """What ddppipe fits its --mem to (ddppipe.slurm.sinfo): each node's memory in the default
    partition and in a named one, parsed from this SLURM's own sinfo; sbatch refuses 1 MB
    more than a node has."""
    from ddppipe.slurm import sinfo

    argv = ["sinfo", "--Node", "--noheader", f"--format={sinfo.NODE_FORMAT}"]
    text = slurm_cluster.run(argv, timeout=30).stdout
    nodes = {node: slurm_cluster.memory_mb for node in slurm_cluster.nodes}
    assert sinfo.parse_node_memory(text, None) == nodes  # (the default partition: short)
    assert sinfo.parse_node_memory(text, "train") == nodes
    too_much = ["sbatch", f"--mem={slurm_cluster.memory_mb + 1}", "--wrap", "true"]
    result = slurm_cluster.run(too_much, check=False, timeout=30)
    assert result.returncode != 0
    assert "Memory specification can not be satisfied" in result.stderr


def test_tcp_rendezvous_across_nodes(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    script = tmp_path / "rendezvous.py"
    script.write_text(RENDEZVOUS)
    out = tmp_path / "rendezvous.out"
    job = slurm_cluster.sbatch(
        "-N2", "--ntasks-per-node=1", f"--output={out}",
        script=RENDEZVOUS_JOB.format(script=script),
    )  # fmt: skip
    assert slurm_cluster.wait_job(job, timeout=60) == "COMPLETED", out.read_text()
    first, second = slurm_cluster.nodes
    addr = slurm_cluster.node_addrs[second]
    assert f"{first} accepted {addr}: hello from {second}" in out.read_text()


def test_host_sbatch_wrap_runs_host_python_on_nodes(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """What the snakemake slurm executor does: sbatch --wrap from the host, PATH exported."""
    out = tmp_path / "wrap.out"
    venv_path = f"{Path(sys.executable).parent}:{slurm_cluster.environ()['PATH']}"
    wrap = "python -c 'import socket, sys; print(sys.executable, socket.gethostname())'"
    job = int(
        slurm_cluster.run(
            ["sbatch", "--parsable", f"--output={out}", "--wrap", wrap], env={"PATH": venv_path}
        ).stdout.strip()
    )
    assert slurm_cluster.wait_job(job) == "COMPLETED", out.read_text()
    executable, host = out.read_text().split()
    assert Path(executable).parent == Path(sys.executable).parent
    assert host in slurm_cluster.nodes


def test_slurm_commands_in_jobs_need_no_slurm_conf(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """snakemake's jobstep executor strips SLURM_* (SLURM_CONF too) before its srun."""
    out = tmp_path / "no-conf.out"
    wrap = "unset SLURM_CONF; srun -n1 hostname; scontrol show config | grep ClusterName"
    job = slurm_cluster.sbatch(f"--output={out}", "--wrap", wrap)
    assert slurm_cluster.wait_job(job) == "COMPLETED", out.read_text()
    assert slurm_cluster.cluster_name in out.read_text()
    host_conf = Path("/etc/slurm/slurm.conf")  # only the nodes see the cluster's there
    assert not (host_conf.exists() and host_conf.samefile(slurm_cluster.conf_path))


def test_scancel_signal_reaches_batch_script(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    out = tmp_path / "signal.out"
    script = (
        "#!/bin/bash\ntrap 'echo got USR1; exit 0' USR1\necho ready\n"
        "for _ in $(seq 60); do sleep 1 & wait $!; done\n"
    )
    job = slurm_cluster.sbatch(f"--output={out}", script=script)
    wait_for_text(out, "ready")
    # Without --batch (or --full), scancel signals only the job's steps, not the script.
    slurm_cluster.run(["scancel", "--signal=USR1", "--batch", str(job)])
    assert slurm_cluster.wait_job(job, timeout=20) == "COMPLETED"
    assert "got USR1" in out.read_text()


def test_preempted_job_gets_usr1_then_requeues_itself(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    out = tmp_path / "preempted.out"
    job = slurm_cluster.sbatch(
        "-N2", "--ntasks-per-node=2", "--signal=B:USR1@60", "--open-mode=append",
        f"--output={out}", script=REQUEUE_ON_USR1_JOB.format(seconds=60),
    )  # fmt: skip
    wait_for_text(out, "started restart=0")
    urgent = slurm_cluster.sbatch(
        f"--partition={slurm_cluster.urgent_partition}", "-N2", "--output=/dev/null",
        "--wrap", "sleep 1",
    )  # fmt: skip
    assert slurm_cluster.wait_job(urgent, timeout=30) == "COMPLETED"
    assert slurm_cluster.wait_job(job, timeout=60) == "COMPLETED"
    log = out.read_text()
    assert "USR1 restart=0" in log
    assert "started restart=1" in log
    assert "never signalled" not in log


# Starts a cluster, then dies by SIGKILL: no stop(), daemons orphaned.
CRASHING_RUN = """\
import os, signal, sys
from pathlib import Path
sys.path.insert(0, {repo!r})
from tests.slurm_cluster import SlurmCluster
SlurmCluster(Path({workdir!r})).start()
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.usefixtures("slurm_cluster")
def test_start_recovers_from_a_crashed_run(slurm_slot: SlurmSlot, tmp_path: Path) -> None:
    """A killed test run leaves daemons, namespaces and hosts entries; start() clears them."""
    repo = str(Path(__file__).resolve().parents[1])
    crash = CRASHING_RUN.format(repo=repo, workdir=str(tmp_path / "crashed"))
    with slurm_slot.suspended():
        killed = subprocess.run([sys.executable, "-c", crash], capture_output=True, check=False)
        assert killed.returncode == -9, killed.stderr.decode()
        orphans = netns_pids("node1")
        assert orphans, "the crashed run left no slurmd behind"
        with slurm_slot.new_cluster("slurm-fresh") as fresh:
            out = fresh.run("srun -N2 hostname", timeout=30).stdout
            assert sorted(out.split()) == ["node1", "node2"]
            assert not set(orphans) & set(netns_pids("node1"))
        assert_no_leftovers([*NODE_ADDRS, *SESSION_NODES])


def assert_no_leftovers(nodes: list[str]) -> None:
    assert not any(Path(f"/run/netns/{node}").exists() for node in nodes)
    link = subprocess.run(["ip", "link", "show", BRIDGE], capture_output=True, check=False)
    assert link.returncode != 0
    assert HOSTS_MARKER not in HOSTS_FILE.read_text()
    assert not STATE_FILE.exists()


def test_settings_replace_add_or_remove_conf_keys(tmp_path: Path) -> None:
    """None takes a key back to Slurm's default (bench/slurm_overhead.py: the scheduler's)."""
    cluster = SlurmCluster(tmp_path, settings={"SchedulerParameters": None, "KillWait": "30",
                                               "JobAcctGatherFrequency": "10"})  # fmt: skip
    lines = cluster._slurm_conf().splitlines()
    assert not [line for line in lines if line.startswith("SchedulerParameters")]
    assert "KillWait=30" in lines and "KillWait=5" not in lines
    assert "JobAcctGatherFrequency=10" in lines
