"""A packed sweep on the session's SLURM cluster (cn07, cn08; partition ``train``): 4 trials
of the digits task, swept over two keys (``train.lr`` and ``launch.nnodes``), in one held
allocation of both nodes with one slot each (``sweep.pack``), instead of one SLURM job per
trial. The one-node trials train side by side, one per node; a two-node trial takes a slot on
each node and runs as an srun step of the allocation on both.

One sbatch call (the allocation: squeue never shows another job of the workdir); every trial
completes as an ordinary run: its attempt names the allocation and its slot(s), the one-node
trials' ranks were forked warm; a second call has nothing to do.

Side by side, on the nodes' other CPU: two packed trials that outlive their allocation (one
minute, a slot on each node): warned before the end, both checkpoint and go on in the next
allocation, which their train jobs submit, from the step they stopped at. Their training is
paced (a task whose steps sleep), so it outlives one allocation and ends in a few on a fast
machine and a slow one alike.
"""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import time
from collections.abc import Iterator

import pytest

from ddppipe.settings import layout
from tests.slurm_fixtures import SlurmSlot
from tests.test_slurm import _finish, _start_snakemake, logs, on_cluster
from tests.test_sweep_slurm import Queue
from tests.tiny import REPO, default_config

pytestmark = pytest.mark.slurm

SWEEP = "packed"
LRS = [0.02, 0.05]
NODES = [1, 2]
TRIALS = [(lr, nodes) for lr in LRS for nodes in NODES]
# The paced trials: blobs (tests/data/blobs.py), 6 steps an epoch of 0.5 s each: 30 s of
# training, against ~30 s of each allocation (warned 30 s before its one-minute end) less a
# slot's start-up (5 s on a fast machine, 15 s on a slow and busy one).
EPOCHS_LIMITED, PACE_S = 10, 0.5
LIMITED_LRS = [0.05, 0.1]


def packed_config(cluster) -> dict:
    cfg = default_config()
    cfg.update(task="ddppipe.tasks.digits", task_args={"width": 8})
    cfg["train"].update(epochs=1, batch_size=64)
    cfg = on_cluster(cfg, cluster, nodes=1, procs=1)
    cfg["sweep"] = {
        "name": SWEEP, "parameters": {"train.lr": LRS, "launch.nnodes": NODES},
        "max_parallel": 4,
        "pack": {"allocations": 1, "nodes": 2, "trials_per_node": 1, "time_min": 10},
    }  # fmt: skip
    return cfg


def limited_config(cluster) -> dict:
    """Two trials that outlive their allocation: blobs, paced (:data:`PACE_S` a step), on one
    CPU each, in allocations of one minute (a slot on each node) whose trials are warned 30 s
    before the end."""
    cfg = packed_config(cluster)
    cfg.update(task=str(REPO / "tests/data/blobs.py"), task_args={"pause_s": PACE_S})
    cfg["train"].update(epochs=EPOCHS_LIMITED, precision="fp32", channels_last=False)
    cfg["slurm"].update(signal_seconds=30)
    cfg["sweep"].update(name="limited", parameters={"train.lr": LIMITED_LRS})
    cfg["sweep"]["pack"].update(time_min=1)
    return cfg


@pytest.fixture(scope="module")
def packed(slurm_slot: SlurmSlot, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    cluster = slurm_slot.cluster()
    root = tmp_path_factory.mktemp("sweep-packed")
    workdir, limited_dir = root / "wd", root / "limited"
    limited, limited_out = _start_snakemake(cluster, limited_dir, limited_config(cluster),
                                            "sweep")  # fmt: skip
    queue = Queue(cluster, workdir)
    text, rc = queue.call(packed_config(cluster))
    limited_text = _finish(limited, limited_out, timeout=240)
    assert rc == 0, logs(workdir, subprocess.CompletedProcess([], rc, text, ""))
    result = subprocess.CompletedProcess([], limited.returncode, limited_text, "")
    assert limited.returncode == 0, logs(limited_dir, result)
    # the call's end closed the pool: its idle allocation ends in seconds, its record closed
    nodes = workdir / layout.SweepLayout(SWEEP).pack / "allocations/nodes"
    deadline = time.monotonic() + 30
    while not all("ended" in json.loads(p.read_text()) for p in nodes.glob("*.json")):
        assert time.monotonic() < deadline, "the allocation did not end with the call"
        time.sleep(0.5)
    yield {"workdir": workdir, "queue": queue, "text": text, "cluster": cluster,
           "limited": limited_dir}  # fmt: skip


def trial_name(lr: float, nodes: int) -> str:
    return f"nnodes={nodes}+lr={lr!r}"  # (the parameters in config.yaml's order: sorted)


def test_the_trials_train_in_one_allocation(packed: dict) -> None:
    queue = packed["queue"]
    assert len(queue.seen) == 1, queue.seen  # one sbatch: the allocation, no job per trial
    (job,) = queue.seen
    pool = packed["workdir"] / layout.SweepLayout(SWEEP).pack
    assert json.loads((pool / "allocations" / f"{job}.json").read_text())["job"] == job
    slots = {}
    for lr, nodes in TRIALS:
        trial = packed["workdir"] / "results/sweeps" / SWEEP / trial_name(lr, nodes)
        history = json.loads((trial / "train/attempts.json").read_text())
        assert [(a["job"], a["outcome"]) for a in history] == [(job, "completed")], history
        assert len(history[0]["nodes"]) == nodes, history
        slots[trial_name(lr, nodes)] = history[0]["slot"]
        assert (trial / "export/model.pt").is_file()
        log = packed["workdir"] / f"logs/sweeps/{SWEEP}/{trial_name(lr, nodes)}/train.log"
        if nodes == 1:
            assert "1 of 1 rank(s) forked warm" in log.read_text(), log.read_text()[-3000:]
    # the one-node trials took either node's slot; each two-node trial one slot of each
    # node, led by the allocation's first
    assert {slots[trial_name(lr, 1)] for lr in LRS} <= {"cn07/0", "cn08/0"}, slots
    assert {slots[trial_name(lr, 2)] for lr in LRS} == {"cn07/0+cn08/0"}, slots
    # the call's last lines: the allocation's cost
    line = re.search(rf"allocations: 1 \(SLURM job {job}\), 2 slot\(s\); held ([\d.]+) CPU-hours",
                     packed["text"])  # fmt: skip
    assert line and float(line[1]) > 0, packed["text"][-2000:]  # its nodes' time, counted
    records = [json.loads(p.read_text()) for p in (pool / "allocations/nodes").glob("*.json")]
    assert sorted(r["node"] for r in records) == ["cn07", "cn08"]
    for node in records:
        assert node["ended"] > node["started"]  # the node gave the allocation back, recorded
        trained = [t for s in node["slot_records"] for t in s["trials"]]
        assert {f"sweeps/{SWEEP}/{trial_name(lr, 2)}" for lr in LRS} <= set(trained), trained
    assert sorted(t for r in records for s in r["slot_records"] for t in s["trials"]) == sorted(
        [f"sweeps/{SWEEP}/{trial_name(lr, 1)}" for lr in LRS]
        + [f"sweeps/{SWEEP}/{trial_name(lr, 2)}" for lr in LRS] * 2
    )


def test_a_second_call_has_nothing_to_do(packed: dict) -> None:
    text, rc = Queue(packed["cluster"], packed["workdir"]).call(packed_config(packed["cluster"]))
    assert rc == 0 and "Nothing to be done" in text, text[-3000:]


def test_trials_outliving_their_allocation_go_on_in_the_next(packed: dict) -> None:
    """Warned before their allocation's end, both trials checkpoint and wait for the next
    allocation (submitted while they waited, by their train jobs), which continues them; no
    step is trained twice, the table lists each trial once."""
    pool = packed["limited"] / layout.SweepLayout("limited").pack
    allocations = {json.loads(p.read_text())["job"] for p in (pool / "allocations").glob("*.json")}
    longest, firsts = 0, set()
    for lr in LIMITED_LRS:
        trial = packed["limited"] / f"results/sweeps/limited/lr={lr!r}"
        *stopped, last = json.loads((trial / "train/attempts.json").read_text())
        firsts.add([*stopped, last][0]["job"])
        assert stopped and last["outcome"] == "completed", (stopped, last)  # (more on a slow day)
        told = [(a["job"], a["outcome"], a["exit_status"], a["detail"][-300:]) for a in stopped]
        assert all(a["outcome"] == "stopped on SIGUSR1" for a in stopped), told
        history = [*stopped, last]
        assert len({a["job"] for a in history}) == len(history)  # each slot its own allocation
        assert {a["job"] for a in history} <= allocations
        for before, after in itertools.pairwise(history):
            assert after["resumed_from"] == before["checkpoint"] is not None  # the stop's
            assert after["start_step"] == before["end_step"] > 0  # no step trained twice
        lines = (trial / "train/metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["epoch"] for line in lines] == list(range(1, EPOCHS_LIMITED + 1))
        longest = max(longest, len(history))
    # both trained in the first allocation side by side, one sbatch per allocation
    assert len(firsts) == 1 and len(allocations) == longest, (firsts, allocations)
    table = (packed["limited"] / "results/sweeps/limited/trials.csv").read_text().splitlines()
    assert len(table) == 1 + len(LIMITED_LRS), table
