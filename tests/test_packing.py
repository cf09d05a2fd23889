"""A packed sweep's parts without a cluster (ddppipe.packing): the pool's queue (each trial
taken once, the oldest first, one stopped by its allocation's end first in line again), an
allocation's sbatch line, the trials it refuses, a node worker's slots running real
processes side by side, and the cost of the allocations."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import threading
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from ddppipe.core import atomic
from ddppipe.launching import resolve
from ddppipe.packing import allocation, allocation_cost, tickets, worker
from ddppipe.packing.allocation import Allocation, PackError
from ddppipe.packing.gang import Gang, Seat, open_gangs
from ddppipe.packing.pool import Pool
from ddppipe.packing.tickets import Ticket, TicketError
from ddppipe.settings import config, layout, run_spec, sweep
from ddppipe.slurm.placement import Placement
from ddppipe.slurm.request import Request
from tests.tiny import default_config

SLOT = {"job": "7", "node": "gpu-a01", "slot": 0}


def test_each_trial_is_taken_once_oldest_first(tmp_path: Path) -> None:
    pool = Pool(tmp_path / "results/sweeps/s/pack")
    for k, run in enumerate(["sweeps/s/b=2", "sweeps/s/a=1", "sweeps/s/c=3"]):
        assert pool.put(Ticket(run, queued=100.0 + k))
    taken: list[str] = []

    def take() -> None:
        while (ticket := pool.take(SLOT)) is not None:
            taken.append(ticket.run)

    threads = [threading.Thread(target=take) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(taken) == ["sweeps/s/a=1", "sweeps/s/b=2", "sweeps/s/c=3"]  # once each
    assert pool.waiting() == 0 and pool.training() == 3


def test_a_trial_stopped_by_its_allocations_end_is_first_in_line(tmp_path: Path) -> None:
    pool = Pool(tmp_path / "results/sweeps/s/pack")
    pool.put(Ticket("sweeps/s/x=1", queued=1.0))
    first = pool.take(SLOT)
    assert first is not None
    pool.put(Ticket("sweeps/s/x=2", queued=2.0))
    pool.give_back(first)  # it checkpointed at the time-limit warning
    again = pool.take(SLOT)
    assert again is not None and again.run == "sweeps/s/x=1"
    # a trial whose allocation SLURM no longer holds goes back too; one of a live one stays
    assert pool.reclaim(held=["8"]) == ["sweeps/s/x=1"]
    assert pool.reclaim(held=[]) == []  # (nothing runs now)
    taken = pool.take({**SLOT, "job": "8"})
    assert taken is not None and taken.run == "sweeps/s/x=1"
    assert pool.reclaim(held=["8"]) == []
    pool.finish(taken, {"exit": 0})
    assert pool.result("sweeps/s/x=1") == {"run": "sweeps/s/x=1", "exit": 0}
    running = pool.take(SLOT)
    assert running is not None and running.run == "sweeps/s/x=2"
    # a second call's train job of a trial that trains already waits for it, queues nothing
    assert not pool.put(Ticket("sweeps/s/x=2"))
    assert pool.waiting() == 0


def packed_spec(tmp_path: Path, **changes: dict) -> run_spec.RunSpec:
    cfg = default_config()
    cfg["sweep"] = {"name": "s", "parameters": {"train.lr": [0.1]},
                    "pack": {"allocations": 2, "nodes": 3, "trials_per_node": 4,
                             "time_min": 90}}  # fmt: skip
    for section, values in changes.items():
        cfg[section].update(values)
    cfg = config.validate(cfg)
    found = sweep.from_config(cfg)
    assert found is not None
    (trial,) = sweep.trials(found)
    gpus = cfg["launch"]["device"] == "gpu"
    return run_spec.resolve(sweep.apply(cfg, found, trial), gpus=gpus)


def test_an_allocations_sbatch_line_holds_its_trials(tmp_path: Path) -> None:
    spec = packed_spec(
        tmp_path,
        launch={"nnodes": 1, "nproc_per_node": 2, "device": "gpu", "cpus_per_proc": 4},
        slurm={"partition": "gpu-short", "account": "proj42", "mem_mb": 16000,
               "signal_seconds": 120},
    )  # fmt: skip
    pool = Pool(tmp_path / "results/sweeps/s/pack")
    line = Allocation.of(spec).sbatch(pool, "/work/wd")
    worker_line = line[-1]
    assert line[:-1] == [
        "sbatch", "--parsable", "--job-name=ddppipe-pack-s", "--nodes=3",
        "--ntasks-per-node=1", "--cpus-per-task=32", "--mem=64000M", "--time=90",
        "--partition=gpu-short", "--account=proj42", "--gres=gpu:8",
        f"--output={tmp_path}/results/sweeps/s/pack/allocations/%j.log", "--chdir=/work/wd",
        "--wrap",
    ]  # fmt: skip
    assert worker_line == (
        "srun --nodes=3 --ntasks-per-node=1 --cpus-per-task=32 --kill-on-bad-exit=0 "
        f"--export=ALL {sys.executable} -m ddppipe pack-worker --pool "
        f"{tmp_path}/results/sweeps/s/pack "
        "--slots 4 --signal-seconds 120 --stop-signal SIGUSR1 --nproc 2 --use gpu "
        "--precision bf16"
    )


def test_a_trial_larger_than_its_allocations_is_refused_with_what_to_do(tmp_path: Path) -> None:
    spec = packed_spec(tmp_path, launch={"nnodes": 4, "device": "cpu"})
    with pytest.raises(PackError, match=r"launch.nnodes 4.*sweep.pack.nodes 3: raise"):
        Allocation.of(spec)
    spec = packed_spec(tmp_path, launch={"nnodes": 2, "device": "cpu"},
                       slurm={"rendezvous_host": "ib-cn07"})  # fmt: skip
    with pytest.raises(PackError, match=r"rendezvous_host \(ib-cn07\).*set slurm.rendezvous_h"):
        Allocation.of(spec)
    fits = packed_spec(tmp_path, launch={"nnodes": 3, "device": "cpu"}, train={"batch_size": 96})
    assert Allocation.of(fits).trial.nodes == 3


def test_a_multi_node_trial_holds_a_slot_on_each_of_its_nodes(tmp_path: Path) -> None:
    """A 3-node trial's gang, led by slot 1 of cn07: one seat each on two other nodes (a node
    sits once, no seat twice); full, it places the trial's step; closed, the seats are free."""
    pool = Pool(tmp_path / "results/sweeps/s/pack")
    pool.put(Ticket("sweeps/s/big", queued=1.0, nodes=3))
    pool.put(Ticket("sweeps/s/small", queued=2.0))
    assert (pool.waiting(), pool.training()) == (4, 0)  # slots: 3 + 1
    small = pool.take({"slot": 0}, max_nodes=1)  # (a node that leads no gang)
    assert small is not None and small.run == "sweeps/s/small"
    big = pool.take({"slot": 1}, max_nodes=3)
    assert big is not None and big.nodes == 3 and pool.training() == 4
    gang = Gang.open(pool, "4242", big, Seat("cn07", 1, [2, 3], ["1"]))
    assert open_gangs(pool, "4242") == [gang] and open_gangs(pool, "99") == []
    assert gang.sit(Seat("cn08", 0, [0, 1], ["0"]))
    assert not gang.sit(Seat("cn08", 1, [2, 3], ["1"]))  # cn08 has its seat
    assert not gang.full
    assert gang.sit(Seat("cn09", 1, [2, 3], ["1"]))
    assert not gang.sit(Seat("cn10", 0, [0, 1], ["0"]))  # no seat left
    assert gang.full and gang.slots() == "cn07/1+cn08/0+cn09/1"
    placed = gang.placement()
    assert placed.nodes == ["cn07", "cn08", "cn09"]
    assert placed.cpus == {"cn07": [2, 3], "cn08": [0, 1], "cn09": [2, 3]}
    assert Placement.from_env(placed.to_env()) == placed
    assert placed.to_env()["SLURM_JOB_ID"] == "4242"
    gang.close()
    assert not gang.is_open and open_gangs(pool, "4242") == []
    assert not gang.sit(Seat("cn10", 0, [0, 1], ["0"]))


def test_a_placed_steps_srun_and_each_nodes_share(tmp_path: Path) -> None:
    """The trial's srun step runs on its gang's nodes beside the workers' step; each node's
    agent keeps to its slot's CPUs and GPUs there."""
    spec = packed_spec(tmp_path, launch={"nnodes": 2, "nproc_per_node": 1, "device": "cpu"})
    placed = Placement("77", ["cn07", "cn08"], {"cn07": [0], "cn08": [1]},
                       {"cn07": ["2"], "cn08": []})  # fmt: skip
    srun = Request.from_spec(spec).srun("77", placement=placed)
    assert srun[-2:] == ["--nodelist=cn07,cn08", "--overlap"] and "--nodes=2" in srun
    cpu = sorted(os.sched_getaffinity(0))[-1]
    check = (
        "import os; from ddppipe.slurm.placement import Placement as P; "
        "P.from_env(os.environ).apply(os.environ); "
        "print(sorted(os.sched_getaffinity(0)), os.environ.get('CUDA_VISIBLE_DEVICES'))"
    )
    for node, gpus in (("cn07", "2"), ("cn08", "None")):
        one = Placement("77", ["cn07", "cn08"], {"cn07": [cpu], "cn08": [cpu]}, placed.gpus)
        env = {**os.environ, **one.to_env(), "SLURMD_NODENAME": node}
        env.pop("CUDA_VISIBLE_DEVICES", None)
        out = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True,
                             text=True, check=True).stdout  # fmt: skip
        assert out.split() == [f"[{cpu}]", gpus], out
    env = {**os.environ, **placed.to_env(), "SLURMD_NODENAME": "cn09"}
    bad = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "node cn09 is none of the placement's cn07, cn08" in bad.stderr


# A trial's torchrun script (one rank): what its slot gave it, written beside its config.
PROGRAM = """
import json, os, sys, time
with open(sys.argv[1], "w") as f:
    json.dump({"start": time.time(), "cpus": sorted(os.sched_getaffinity(0)),
               "slot": os.environ.get("DDPPIPE_PACKED_SLOT"),
               "slurm": [k for k in os.environ if k.startswith("SLURM_")]}, f)
time.sleep(1.0)
sys.exit(int(sys.argv[2]))
"""


def script_trial(name: str, program: Path, code: int) -> Ticket:
    """The ticket of trial ``name`` of sweep s, a script run of ``program`` exiting ``code``
    (its resolved config written where the run's layout has it, in this folder)."""
    cfg = default_config()
    cfg.update(run=f"sweeps/s/{name}", script=str(program), task_args={},
               script_args=[str(Path(f"{name}.json").resolve()), str(code)])  # fmt: skip
    cfg["launch"].update(nproc_per_node=1, device="cpu")
    cfg["tracking"]["tensorboard"] = False
    resolve.write_resolved(cfg, layout.RunLayout(cfg["run"]).config)
    return Ticket(cfg["run"], kind="script")


def test_a_nodes_slots_run_trials_side_by_side(tmp_path: Path, monkeypatch) -> None:
    """Two slots, four trials, one failing (its script exits 3): each trial's own launch
    command runs in a slot on its own CPU, two at once, in the sweep's order, each trial's
    status back to its train job; the worker ends once the call closed the pool."""
    assert len(os.sched_getaffinity(0)) >= 2, "the test needs 2 CPUs (CI's machine has 2)"
    monkeypatch.chdir(tmp_path)
    pool = Pool(Path("results/sweeps/s/pack"))
    program = tmp_path / "trial.py"
    program.write_text(PROGRAM)
    codes = {"a": 0, "b": 3, "c": 0, "d": 0}
    for k, name in enumerate(codes):
        pool.put(replace(script_trial(name, program, codes[name]), order=k, queued=10.0 - k))
    pool.close()  # no more trials come: the worker ends when these are done
    monkeypatch.setenv("SLURM_JOB_NAME", "leaks")  # not the trial's job: removed
    cpus = sorted(os.sched_getaffinity(0))[:2]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(cpus))
    pool.closed.touch()
    assert worker.serve(pool.root, 2, 60, "SIGUSR1") == 0
    seen = {n: json.loads((tmp_path / f"{n}.json").read_text()) for n in codes}
    assert {n: pool.result(f"sweeps/s/{n}")["exit"] for n in codes} == codes
    assert sorted({tuple(s["cpus"]) for s in seen.values()}) == [(cpus[0],), (cpus[1],)]
    assert all(s["slurm"] == [] and s["slot"].startswith("local ") for s in seen.values())
    assert abs(seen["a"]["start"] - seen["b"]["start"]) < 1.0  # side by side
    first, then = (seen["a"]["start"], seen["b"]["start"]), (seen["c"]["start"], seen["d"]["start"])
    assert max(first) < min(then)  # in the sweep's order, not the queue's
    history = json.loads(Path("results/sweeps/s/b/state/attempts.json").read_text())
    assert [a["outcome"] for a in history] == ["crashed (exit 3)"]
    node = json.loads(next((pool.allocations / "nodes").glob("*.json")).read_text())
    assert sorted(t for s in node["slot_records"] for t in s["trials"]) == [
        f"sweeps/s/{n}" for n in codes
    ]


def test_a_node_that_fails_its_preflight_takes_no_trial(tmp_path: Path) -> None:
    """GPU trials on a node without a usable GPU (this machine): the node's check fails, the
    trial stays queued for another node, and the pool's next allocation excludes this one."""
    pool = Pool(tmp_path / "results/sweeps/s/pack")
    pool.put(Ticket("sweeps/s/a"))
    assert worker.serve(pool.root, 1, 60, "SIGUSR1", (1, "gpu", "fp32")) == 0
    assert pool.waiting() == 1 and pool.result("sweeps/s/a") is None
    (node,) = pool.records(pool.allocations / "nodes")
    assert node["node"] == socket.gethostname() and "GPU" in " ".join(node["preflight"])
    assert list(pool.failed_preflight()) == [socket.gethostname()]
    spec = packed_spec(tmp_path, launch={"nnodes": 1, "device": "cpu"})
    decision = allocation.exclude_bad_nodes(pool, spec.slurm.max_excluded_nodes)
    assert decision is not None and decision.excluded == [socket.gethostname()]
    assert pool.bad_nodes.load() == [socket.gethostname()] and pool.failed_preflight() == {}
    assert f"--exclude={socket.gethostname()}" in Allocation.of(spec).sbatch(pool, "/wd")


def test_the_cost_of_the_allocations(tmp_path: Path) -> None:
    """Two allocations: one node of 2 slots held 100 s (trials busy 150 slot-s of the 180
    up to each slot's last trial), one node of 2 slots held 50 s; 4 CPUs a node."""
    pool = Pool(tmp_path / "results/sweeps/s/pack")
    (pool.allocations / "nodes").mkdir(parents=True)
    for job, submitted in (("11", 990.0), ("12", 1020.0)):
        (pool.allocations / f"{job}.json").write_text(
            json.dumps({"job": job, "submitted": submitted})
        )
    nodes = [
        {"job": "11", "node": "n1", "slots": 2, "started": 1000.0, "ended": 1100.0, "cpus": 4,
         "gpus": 0, "slot_records": [{"busy_s": 80.0, "last_end": 1090.0, "trials": ["a"]},
                                     {"busy_s": 70.0, "last_end": 1090.0, "trials": ["b"]}]},
        {"job": "12", "node": "n2", "slots": 2, "started": 1050.0, "ended": 1100.0, "cpus": 4,
         "gpus": 0, "slot_records": [{"busy_s": 40.0, "last_end": 1100.0, "trials": ["c"]},
                                     {"busy_s": 0.0, "last_end": None, "trials": []}]},
    ]  # fmt: skip
    for n in nodes:
        (pool.allocations / "nodes" / f"{n['job']}-{n['node']}.json").write_text(json.dumps(n))
    found = allocation_cost.cost(pool.root)
    assert found is not None
    assert found.jobs == ["11", "12"] and found.slots == 4
    assert found.held_hours == pytest.approx((100 * 4 + 50 * 4) / 3600)
    assert found.busy_s == 190.0 and found.span_s == 90 + 90 + 50
    assert found.idle_while_trials == pytest.approx(1 - 190 / 230)
    assert found.queue_s == [10.0, 30.0]
    written = allocation_cost.write(pool.root)
    assert json.loads(pool.cost.read_text())["jobs"] == ["11", "12"]
    assert (
        written
        == allocation_cost.line(pool.root)
        == (
            "allocations: 2 (SLURM jobs 11, 12), 4 slot(s); held 0.1667 CPU-hours, idle 17% of "
            "the slots' time while trials remained, queue wait 30 s at most"
        )
    )


def test_the_scheduler_is_asked_at_once_only_while_no_allocation_comes(tmp_path: Path) -> None:
    """A packed trial's train job checks the allocations at once (squeue, sbatch) only while
    none is queued or running; else at the pool's pace, however many trials arrive."""
    pool = Pool(tmp_path / "results/sweeps/s/pack")
    pool.put(Ticket("sweeps/s/a"))
    assert not pool.expected()  # nothing submitted yet
    atomic.write_json(pool.allocations / "5.json", {"job": "5"})
    assert pool.expected()  # queued: no node record yet
    nodes = pool.allocations / "nodes"
    atomic.write_json(nodes / "5-cn07.json", {"job": "5", "node": "cn07", "started": 1.0})
    atomic.write_json(nodes / "5-cn08.json", {"job": "5", "node": "cn08", "started": 1.0})
    assert pool.expected()
    atomic.write_json(nodes / "5-cn07.json", {"job": "5", "node": "cn07", "ended": 2.0})
    assert pool.expected()  # cn08 still takes trials
    atomic.write_json(nodes / "5-cn08.json", {"job": "5", "node": "cn08", "ended": 2.0})
    assert not pool.expected()


def test_a_packed_trials_summary_asks_sacct_nothing_of_its_allocation() -> None:
    """The allocation's job holds other trials too: sacct's figures of it are not the run's."""
    from ddppipe.reports.run_files import RunFiles

    attempts = [{"job": "7", "slot": "cn07/1"}, {"job": "9", "slot": None}, {"job": "local"}]
    files = RunFiles(None, None, [], attempts, {})  # type: ignore[arg-type]
    assert files.jobs == ["9"]


# -- who may queue a trial ---------------------------------------------------------------------


def test_a_ticket_with_a_command_or_of_another_user_runs_nothing(
    tmp_path: Path, monkeypatch
) -> None:
    """Tickets dropped into the queue by hand: one holding a command (the old shape), one of
    the user nobody naming a trial, one naming a run outside the sweep. A node's worker runs
    none of them: each is set aside in refused/ with its reason, logged."""
    monkeypatch.chdir(tmp_path)
    pool = Pool(Path("results/sweeps/s/pack"))
    pool.put(Ticket("sweeps/s/real", queued=1.0))
    pool.withdraw("sweeps/s/real")  # (the queue folders exist, as in a running sweep)
    marker = tmp_path / "ran"
    dropped = {
        "command.json": {"run": "sweeps/s/x", "command": ["touch", str(marker)], "cwd": "/"},
        "foreign.json": {**asdict(Ticket("sweeps/s/y")), "nodes": 1},
        "outside.json": asdict(Ticket("sweeps/other/z")),
        "escape.json": asdict(Ticket("sweeps/s/../../../etc")),
    }
    for name, record in dropped.items():
        (pool.queue / name).write_text(json.dumps(record))
    os.chown(pool.queue / "foreign.json", 65534, 65534)
    pool.close(wait_s=0)
    assert worker.serve(pool.root, 1, 60, "SIGUSR1") == 0
    assert not marker.exists() and not list(pool.queue.iterdir())
    assert not (pool.running.exists() and list(pool.running.iterdir()))
    reasons = {p.name: json.loads(p.read_text())["refused"] for p in pool.refused.iterdir()}
    queue = pool.queue
    assert reasons == {
        "command.json": f"{queue}/command.json is no ticket (a ticket holds run, data, kind, "
        "nodes, order, queued; no command)",
        "foreign.json": f"{queue}/foreign.json is owned by uid 65534, not by this user "
        f"(uid {os.getuid()})",
        "outside.json": f"{queue}/outside.json names 'sweeps/other/z', no trial of sweep s "
        "(sweeps/s/<trial>)",
        "escape.json": f"{queue}/escape.json names 'sweeps/s/../../../etc', no trial of sweep "
        "s (sweeps/s/<trial>)",
    }
    kept = json.loads((pool.refused / "command.json").read_text())["ticket"]
    assert kept == dropped["command.json"]


def test_a_queue_others_may_write_is_refused_with_its_path(tmp_path: Path, monkeypatch) -> None:
    """Made under umask 002 (a group's shared project folder), the pool's folders are not
    group-writable; one made so afterwards is refused by the train job and by the node, the
    path and its mode named."""
    monkeypatch.chdir(tmp_path)
    pool = Pool(Path("results/sweeps/s/pack"))
    umask = os.umask(0o002)
    try:
        assert pool.put(Ticket("sweeps/s/a", queued=1.0))
    finally:
        os.umask(umask)
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in (pool.root, pool.queue, pool.done)}
    assert modes == {"pack": 0o755, "queue": 0o755, "done": 0o755}
    pool.queue.chmod(0o775)
    why = ("refusing the packed sweep's queue: results/sweeps/s/pack/queue (drwxrwxr-x) may be "
           "written by other users, who could queue trials there: chmod go-w "
           "results/sweeps/s/pack/queue")  # fmt: skip
    with pytest.raises(TicketError) as refused:
        pool.put(Ticket("sweeps/s/b"))
    assert str(refused.value) == why
    with pytest.raises(TicketError) as refused:
        pool.take(SLOT)
    assert str(refused.value) == why
    assert pool.waiting() == 1  # nothing taken


def test_a_ticket_is_the_trial_the_rule_launches(tmp_path: Path) -> None:
    """The train rule's launch command of a packed trial becomes its ticket (run, data, kind);
    the node builds the same command back. A command with other paths is refused."""
    run = "results/sweeps/s/lr=0.1"
    rule = ["ddppipe", "launch", "--config", f"{run}/config.yaml", "--data", "resources/mnist",
            "--state", f"{run}/state", "--checkpoint", f"{run}/train/final.pt",
            "--metrics", f"{run}/train/metrics.jsonl", "--attempts", f"{run}/train/attempts.json",
            "--log", "logs/sweeps/s/lr=0.1/train.log"]  # fmt: skip
    ticket = tickets.of_launch("sweeps/s/lr=0.1", "task", 2, 5, rule)
    assert ticket == Ticket("sweeps/s/lr=0.1", "resources/mnist", "task", 2, 5, ticket.queued)
    assert tickets.launch_command(ticket) == [sys.executable, "-m", "ddppipe", *rule[1:]]
    other = [*rule[:-1], "/tmp/elsewhere.log"]
    with pytest.raises(TicketError, match=(
        r"trial sweeps/s/lr=0.1's launch command differs from the one its allocation's node "
        r"builds: --log /tmp/elsewhere.log \(its node gives logs/sweeps/s/lr=0.1/train.log\)"
    )):  # fmt: skip
        tickets.of_launch("sweeps/s/lr=0.1", "task", 1, 0, other)


def test_each_gpu_slot_gets_gpus_of_its_own_or_the_node_takes_no_trial() -> None:
    """Two slots of 2-GPU trials: the allocation's four GPUs shared out, two each; with no
    CUDA_VISIBLE_DEVICES in the worker's step (every slot would see every GPU, each trial's
    rank 0 on cuda:0) or too few, refused, saying why."""
    shared = worker.slots_of_node(2, {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, gpus_each=2)
    assert [s.gpus for s in shared] == [["0", "1"], ["2", "3"]]
    assert [s.gpus for s in worker.slots_of_node(2, {"CUDA_VISIBLE_DEVICES": "0,1"})] == [[], []]
    with pytest.raises(PackError) as refused:
        worker.slots_of_node(2, {}, gpus_each=2)
    assert str(refused.value).startswith(
        "2 slot(s) of 2 GPU(s) each need 4 GPUs of the allocation, and its step shows 0 "
        "(CUDA_VISIBLE_DEVICES=unset): the trials would share GPUs."
    )
    with pytest.raises(PackError, match=r"shows 3 \(CUDA_VISIBLE_DEVICES='0,1,2'\)"):
        worker.slots_of_node(2, {"CUDA_VISIBLE_DEVICES": "0,1,2"}, gpus_each=2)
