"""A node lost mid-slot, recovered inside the job (``slurm.spare_nodes``, ``slurm.min_nodes``),
and a node drained mid-slot, on a SLURM cluster of its own: three nodes ``cn[11-13]`` in
partition ``train``, three more ``mt[01-03]`` in partition ``maint``.

Three runs train side by side, one rank a node (each job takes one of a node's four CPUs): a
2-node run with one spare node (a 3-node job), a 2-node run with ``min_nodes: 1`` (a 2-node
job) and a 2-node run with neither. All are held mid-epoch 2 (their task waits while a file
exists) with their epoch-1 checkpoint committed, then the node their steps share, no job's
batch node, is killed as a node dies: its slurmd and every process on it; they are released
once SLURM has declared it down (a job submitted without ``--no-kill`` ends then). The first
two go on in their jobs, with no new submission, both from the epoch-1 checkpoint: the spare
run (its rank 0 on the lost node: its other rank fails on the lost peer at once, so it goes
on before SLURM's word) on its node left and the spare (its job's first node, idle until
then), the other on its first node alone (2 micro-steps a step: its rank's batch kept). The
third, submitted without ``--no-kill``, is ended by SLURM and requeued (its profile's
``--requeue``): the same job resumes on cn11 and cn13.

Beside them, in ``maint``, a 2-node run in 1-minute slots: held in its first slot, one of its
nodes drained as the slot starts, as an administrator drains for maintenance (``scontrol
update state=drain``: its processes run on), released at the time limit's warning. The slot
ends as a time limit (not a node failure), the job requeues itself, and its next slot, the
same job, runs on the two nodes left and completes.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ddppipe.slurm import scontrol
from tests.slurm_cluster import SlurmCluster, kill_pids, netns_pids
from tests.slurm_fixtures import TRAIN_PARTITION, SlurmSlot
from tests.test_slurm import (
    _finish,
    _poll,
    _result,
    _start_snakemake,
    _stop,
    logs,
    on_cluster,
    train_job_ids,
)
from tests.tiny import default_config, points_task

pytestmark = pytest.mark.slurm
NODES = ("cn11", "cn12", "cn13")
MAINT_NODES = ("mt01", "mt02", "mt03")  # the drained node's run, apart from the lost node's
MAINT_PARTITION = "maint"
PARTITIONS = {
    "batch": "Default=YES MaxTime=INFINITE State=UP",
    TRAIN_PARTITION: "Nodes=cn[11-13] MaxTime=INFINITE State=UP",
    MAINT_PARTITION: "Nodes=mt[01-03] MaxTime=INFINITE State=UP",
}
SLURM = {"spare": {"spare_nodes": 1}, "shrink": {"min_nodes": 1}, "plain": {}}
STEPS_PER_EPOCH = 50  # 1,600 training samples, a global batch of 32
# SLURM declares a silent node down after this (Slurm's default: 300 s). The runs are held
# until it has: a job without --no-kill would end then.
SLURMD_TIMEOUT_S = 20
HOLD_AFTER = STEPS_PER_EPOCH + 10  # each rank waits at epoch 2's 11th step while `hold` exists

# A user's task (2,000 points in 16 dimensions): once a rank has trained HOLD_AFTER batches, it
# waits while `hold` exists, saying so in `held-<rank>` (rank 0, whose probes of the step add
# forward calls, holds first; the other rank waits for it in the step's all-reduce).
TASK = points_task(dim=16, hidden=32, noise=1.0, hold_after=HOLD_AFTER)
FINAL = "results/points/train/final.pt"
EPOCH_1 = "results/points/state/checkpoints/ckpt-e0001-s000000"
# The drained node's run: slots of 1 minute, the warning 20 s before the end; each rank held
# once it has trained 5 batches (so that the slot trains until the warning, however quick its
# start), or still starting at the warning (beside the other runs on 2 cores).
DRAIN_RUNTIME_MIN, DRAIN_WARNING_S = 1, 20
DRAIN_TASK = points_task(dim=16, hidden=32, noise=1.0, hold_after=5)
WARNED = "time-limit warning: SIGUSR1 to the training"  # (the launcher's live log, below)
LIVE_LOG = "results/points/state/train.log"


def points_config(cluster: SlurmCluster, **slurm: Any) -> dict[str, Any]:
    cfg = default_config()
    cfg.update(run="points", task="points.py", task_args={"samples": 2000})
    cfg["train"].update(epochs=2, batch_size=32, eval_batch_size=400, checkpoint_every=1)
    on_cluster(cfg, cluster, nodes=2, procs=1)
    cfg["slurm"].update(slurm)
    return cfg


def node_down(cluster: SlurmCluster, node: str) -> float | None:
    """When SLURM has declared ``node`` down (None until then)."""
    state = cluster.run(["sinfo", "-h", "-n", node, "-o", "%T"], check=False).stdout
    return time.time() if "down" in state else None


def drain_config(cluster: SlurmCluster) -> dict[str, Any]:
    cfg = points_config(cluster)
    cfg["slurm"].update(partition=MAINT_PARTITION, runtime=DRAIN_RUNTIME_MIN,
                        signal_seconds=DRAIN_WARNING_S)  # fmt: skip
    return cfg


def drain_mid_slot(cluster: SlurmCluster, wd: Path, found: dict[str, Any]) -> None:
    """Once the first slot of the run in ``wd`` runs, drain the second node of its job for
    maintenance; release the run's hold at the time limit's warning. What happened goes to
    ``found`` (``error``: why it could not)."""
    train_log = wd / LIVE_LOG
    try:
        _wait_for(lambda: attempts(wd), 300, "the drain run's first slot")  # (its launcher's)
        node = attempts(wd)[0]["nodes"][1]
        cluster.run(["scontrol", "update", f"nodename={node}", "state=drain",
                     "reason=maintenance"])  # fmt: skip
        found.update(drained=node, drained_at=time.time())
        found["read"] = {node: _node_state(cluster, node)}  # (as the launcher reads it)
        # the third node, idle: drained as slurmd drains a node whose job would not die,
        # read, and given back before the next slot needs it
        idle = next(n for n in MAINT_NODES if n not in attempts(wd)[0]["nodes"])
        cluster.run(["scontrol", "update", f"nodename={idle}", "state=drain",
                     "reason=Kill task failed"])  # fmt: skip
        found["read"][idle] = _node_state(cluster, idle)
        cluster.run(["scontrol", "update", f"nodename={idle}", "state=resume"])
        _wait_for(lambda: train_log.exists() and WARNED in train_log.read_text(), 120,
                  "the time limit's warning")  # fmt: skip
        found["warned_at"] = time.time()
        found["state"] = cluster.run(["sinfo", "-h", "-n", node, "-o", "%T"]).stdout.strip()
    except Exception as e:  # (said by the test)
        found["error"] = repr(e)
    finally:
        (wd / "hold").unlink(missing_ok=True)


def _node_state(cluster: SlurmCluster, node: str) -> str | None:
    line = cluster.run(["scontrol", "-o", "show", "node", node]).stdout
    found = scontrol.parse_node_state(line)
    return found and found[1]


def _wait_for(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout:.0f}s")
        time.sleep(0.2)


def attempts(wd: Path) -> list[dict[str, Any]]:
    path = wd / "results/points/state/attempts.json"
    return json.loads(path.read_text()) if path.exists() else []


@pytest.fixture(scope="module")
def runs(slurm_slot: SlurmSlot, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """The three runs, held mid-epoch 2, then the node their steps share killed: each run's
    snakemake output, working directory, the node killed and when."""
    root = tmp_path_factory.mktemp("spare-nodes")
    shape = {"nodes": NODES + MAINT_NODES, "partitions": PARTITIONS, "gpus_per_node": 0,
             "cpus_per_node": 4, "settings": {"SlurmdTimeout": str(SLURMD_TIMEOUT_S)}}  # fmt: skip
    with slurm_slot.suspended(), slurm_slot.new_cluster("slurm-spare", **shape) as cluster:
        found: dict[str, Any] = {}
        procs = {}
        for name, slurm in SLURM.items():  # each job on the first nodes: 4 CPUs a node
            wd = root / name
            wd.mkdir()
            (wd / "points.py").write_text(TASK)
            (wd / "hold").touch()
            procs[name] = _start_snakemake(cluster, wd, points_config(cluster, **slurm), FINAL)
        drain_wd = root / "drain"
        drain_wd.mkdir()
        (drain_wd / "points.py").write_text(DRAIN_TASK)
        (drain_wd / "hold").touch()
        drain = _start_snakemake(cluster, drain_wd, drain_config(cluster), FINAL)
        drained: dict[str, Any] = {"wd": drain_wd, "started": time.time()}
        drainer = threading.Thread(target=drain_mid_slot, args=(cluster, drain_wd, drained))
        drainer.start()
        try:
            for name, (proc, out) in procs.items():
                wd = root / name
                _poll(lambda wd=wd: (wd / "held-0").exists(), proc, 600,  # rank 1 then waits
                      f"the {name} run held in epoch 2", out)  # fmt: skip
                # (its epoch-1 checkpoint is written in the background: committed by now?
                # epoch 2's first 10 steps take milliseconds, the save longer)
                _poll(lambda wd=wd: (wd / EPOCH_1 / "COMMITTED").is_file(), proc, 120,
                      f"the {name} run's epoch-1 checkpoint committed", out)  # fmt: skip
            steps = {name: attempts(root / name)[0]["nodes"] for name in procs}
            shared = set(NODES).intersection(*steps.values()) - {NODES[0]}  # (the batch nodes)
            assert len(shared) == 1, f"no node to kill: {steps}"
            victim = shared.pop()
            killed = time.time()
            kill_pids(netns_pids(victim), grace=0)  # the node dies: slurmd, steps, ranks
            # (the plain run is held until then; the spare run may have gone on already)
            down = _poll(lambda: node_down(cluster, victim), procs["plain"][0], 120,
                         f"{victim} down in SLURM", procs["plain"][1])  # fmt: skip
            for name in procs:  # the ranks left go on, and fail on their lost peer
                (root / name / "hold").unlink()
            for name, (proc, out) in procs.items():
                found[name] = {"result": _result(proc, _finish(proc, out, timeout=300)),
                               "wd": root / name, "steps": steps[name]}  # fmt: skip
            found.update(victim=victim, killed=killed, down=down - killed, cluster=cluster)
            drainer.join(timeout=300)
            drained["result"] = _result(drain[0], _finish(*drain, timeout=300))
            drained["ended"] = time.time()
            found["drain"] = drained
            found["jobs"] = cluster.run("squeue -h -t all -o '%i|%T|%N|%k'").stdout
            yield found
        finally:
            (drain_wd / "hold").unlink(missing_ok=True)
            for proc, _ in [*procs.values(), drain]:
                if proc.poll() is None:
                    _stop(proc)


def check_one_job(run: dict[str, Any], victim: str) -> list[dict[str, Any]]:
    """The run completed in one job, its first slot ended by the loss of ``victim`` (recorded
    as a bad node), its second resumed from the epoch-1 checkpoint: the history."""
    result, wd = run["result"], run["wd"]
    assert result.returncode == 0, logs(wd, result)
    jobs = train_job_ids(result)
    assert len(jobs) == 1, f"more than one submission of train: {jobs}"
    history = attempts(wd)
    assert [a["outcome"] for a in history] == ["node failure", "completed"], history
    assert {a["job"] for a in history} == {jobs[0]}, history
    assert [a["restarts"] for a in history] == [0, 0], history  # no requeue: the same slot
    lost, done = history
    assert lost["detail"].startswith(f"{victim}: "), lost  # its agent silent, or SLURM's word
    assert done["resumed_from"].startswith("ckpt-e0001-") and done["start_step"] == 50, done
    assert json.loads((wd / "results/points/state/excluded-nodes.json").read_text()) == [victim]
    train_log = (wd / "logs/points/train.log").read_text()
    assert f"going on in job {jobs[0]} on " in train_log, train_log[-3000:]
    return history


def test_a_lost_node_is_replaced_by_the_spare_in_the_same_job(runs: dict) -> None:
    """The 2-node run with a spare: its first step on the nodes after its job's first (the
    launcher's, whose loss would end the job: the spare), the next on the node left and the
    spare, from the epoch-1 checkpoint, in the same job; the final weights trained there."""
    run, victim = runs["spare"], runs["victim"]
    history = check_one_job(run, victim)
    assert run["steps"] == ["cn12", "cn13"], run["steps"]
    assert history[1]["nodes"] == ["cn11", "cn13"], history
    assert history[1]["world_size"] == 2, history
    hosts = torch.load(run["wd"] / FINAL, weights_only=False)["meta"]["hosts"]
    assert sorted(set(hosts)) == ["cn11", "cn13"], hosts
    lost_at, started, ended = (t - runs["killed"] for t in (
        history[0]["end"], history[1]["start"], history[1]["end"]))  # fmt: skip
    print(f"(spare) {victim} killed, down in SLURM {runs['down']:.1f}s later; the slot's end "
          f"recorded {lost_at:.1f}s, the next slot started {started:.1f}s, completed "
          f"{ended:.1f}s after the kill; jobs:\n{runs['jobs']}")  # fmt: skip


def test_without_a_spare_min_nodes_goes_on_at_the_smaller_world(runs: dict) -> None:
    """The 2-node run with min_nodes 1: the next step on its first node alone (world size 1,
    the global batch kept: the same steps an epoch; its rank's batch too: 2 micro-steps a
    step), from the epoch-1 checkpoint."""
    run, victim = runs["shrink"], runs["victim"]
    history = check_one_job(run, victim)
    assert history[1]["nodes"] == [run["steps"][0]] and history[1]["world_size"] == 1, history
    assert history[1]["end_step"] == 2 * STEPS_PER_EPOCH, history
    # each rank's batch kept (16 of the 32): 2 micro-steps a step, gradients accumulated
    assert [a["micro_steps"] for a in history] == [1, 2], history
    train_log = (run["wd"] / "logs/points/train.log").read_text()
    said = "a smaller world: 1 rank(s) of the run's 2: each trains 2 micro-steps a step of up to 16"
    assert said in train_log, train_log[-3000:]
    print(
        f"(shrink) the next slot started {history[1]['start'] - runs['killed']:.1f}s after "
        f"the kill, on {history[1]['nodes']}"
    )


def test_a_lost_node_without_spare_requeues_the_job_and_resumes_on_other_nodes(runs: dict) -> None:
    """The 2-node run with neither key: SLURM ends the job when it declares the node down and
    requeues it (same job id); the plugin waits for it and submits no second job that would
    train alongside; the requeued slot resumes from the epoch-1 checkpoint on other nodes."""
    run, victim = runs["plain"], runs["victim"]
    result, wd = run["result"], run["wd"]
    assert result.returncode == 0, logs(wd, result)
    jobs = train_job_ids(result)
    assert len(jobs) == 1, f"more than one submission of train: {jobs}"
    history = attempts(wd)
    # srun may exit 0 on a node failure: the slot on the lost node never counts as complete
    assert history[0]["outcome"] in ("node failure", "requeued by SLURM", "ended by SLURM")
    assert history[-1]["outcome"] == "completed" and history[-1]["restarts"] >= 1, history
    assert {a["job"] for a in history} == {jobs[0]}, history
    assert victim not in history[-1]["nodes"], history
    assert history[-1]["resumed_from"].startswith("ckpt-e0001-"), history
    hosts = torch.load(wd / FINAL, weights_only=False)["meta"]["hosts"]
    assert victim not in hosts, hosts
    print(f"(no spare) requeued: slots {[(a['nodes'], a['outcome']) for a in history]}")


def test_a_node_drained_mid_slot_leaves_the_time_limit_a_time_limit(runs: dict) -> None:
    """The run in ``maint``, one of its job's two nodes drained mid-slot: the slot ends at its
    time limit's warning as a time limit (a drained node runs its jobs on: no node failure, no
    bad node), the job requeues itself (one job id), and its next slot runs on the two nodes
    left (SLURM gives a drained node no job) and completes from the stop checkpoint."""
    run = runs["drain"]
    assert "error" not in run, run
    result, wd, node = run["result"], run["wd"], run["drained"]
    assert result.returncode == 0, logs(wd, result)
    assert "drain" in run["state"], run  # still running the slot: "draining"
    # SLURM's own lines, read as the launcher reads them: a drain for maintenance is no
    # failure, one of slurmd's for a task it could not kill is
    idle = next(n for n in run["read"] if n != node)
    assert run["read"] == {node: "MIXED+DRAIN", idle: "IDLE+DRAIN+KILL_TASK_FAILED"}, run
    assert scontrol.failed_nodes(run["read"]) == [idle], run
    jobs, history = train_job_ids(result), attempts(wd)
    assert len(jobs) == 1, (
        f"more than one submission of train: {jobs} {history}\n{logs(wd, result)}"
    )
    assert [a["outcome"] for a in history] == ["time limit", "completed"], history
    assert [a["job"] for a in history] == jobs * 2, history
    assert [a["restarts"] for a in history] == [0, 1], history  # the job's own requeue
    first, second = history
    assert node in first["nodes"], history
    assert sorted(second["nodes"]) == sorted(set(MAINT_NODES) - {node}), history
    assert second["start_step"] == first["end_step"] > 5, history  # the stop's checkpoint
    assert second["end_step"] == 2 * STEPS_PER_EPOCH, history
    assert not (wd / "results/points/state/excluded-nodes.json").exists()
    hosts = torch.load(wd / FINAL, weights_only=False)["meta"]["hosts"]
    assert node not in hosts, hosts
    at = {k: run[k] - run["started"] for k in ("drained_at", "warned_at", "ended")}
    print(
        f"(drained) {node} drained {at['drained_at']:.1f}s after the start, the warning "
        f"{at['warned_at']:.1f}s, the run done {at['ended']:.1f}s; job {jobs[0]}, slots "
        f"{[(a['nodes'], a['outcome'], a['start_step'], a['end_step']) for a in history]}"
    )
