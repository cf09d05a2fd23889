"""The default memory request (``slurm.mem_mb: null``): what a node's processes need before
the first slot, the last slot's measured peak after it, and the summary's flag of a peak near
or above the request."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from ddppipe.packing.allocation import Allocation
from ddppipe.reports import slot_lines
from ddppipe.runstate import attempts
from ddppipe.runstate.attempts import Attempt
from ddppipe.runstate.state import StateDir
from ddppipe.settings import config, run_spec, sweep
from ddppipe.settings.runs import Runs
from ddppipe.slurm import memory_request, request
from tests.tiny import default_config

# The default MNIST run, 2 CPU ranks on a node in fp32 (a CPU without bfloat16: auto's choice
# there), its node's peak as its attempt record has it: tests/test_slurm.py's real-MNIST run on
# the test cluster with torch's kernels capped at AVX2 (2026-11-29, the 2-core AMD EPYC).
DEFAULT_RUN_PEAK_MB = 2668.0


def spec(**launch: object) -> run_spec.RunSpec:
    cfg = default_config()
    cfg["launch"].update(launch)
    return run_spec.resolve(cfg, gpus=cfg["launch"]["device"] == "gpu")


@pytest.mark.parametrize(("procs", "gpu", "mem_mb"), [
    (1, False, 2100), (2, False, 3400), (8, False, 11300), (2, True, 16000),
])  # fmt: skip
def test_the_estimate_before_the_first_slot(procs: int, gpu: bool, mem_mb: int) -> None:
    device = "gpu" if gpu else "cpu"
    assert request.Request.from_spec(spec(nproc_per_node=procs, device=device)).mem_mb == mem_mb


# A task whose model has 1.3 billion parameters (an embedding of 1,300,000 x 1,000): the size
# the issue names (15.6 GB of parameters and AdamW's state), counted without allocating them.
BIG_TASK = """\
from torch import nn

ARGS_SCHEMA = {"type": "object", "properties": {"rows": {"type": "integer", "default": 1300000}}}


def prepare(data_dir, args):
    pass


def datasets(data_dir, args):
    raise NotImplementedError


def model(args):
    return nn.Embedding(args["rows"], 1000)
"""
# One that loads its weights: not buildable on the meta device.
LOADING_TASK = BIG_TASK.replace('return nn.Embedding(args["rows"], 1000)',
                                'import torch; return torch.load("weights.pt")')  # fmt: skip


@pytest.mark.parametrize(("parameters", "optimizer", "shards", "mb"), [
    (1_300_000_000, "adamw", 1, 14878),  # 15,600,000,000 bytes: 14,877.3 MiB
    (1_300_000_000, "adadelta", 1, 14878),  # two buffers a parameter too
    (1_300_000_000, "sgd", 1, 9919),  # momentum only: 10,400,000,000 bytes
    (1_300_000_000, "adamw", 8, 1860),  # an FSDP rank of 8: its shard
    (0, "adamw", 1, 0),
])  # fmt: skip
def test_what_a_gpu_process_pins_for_its_checkpoints(
    parameters: int, optimizer: str, shards: int, mb: int
) -> None:
    assert memory_request.pinned_mb(parameters, optimizer, shards) == mb


@pytest.mark.parametrize(("task", "optimizer", "launch", "pinned", "mem_mb"), [
    (BIG_TASK, "adamw", {"nproc_per_node": 1}, 14878, 22900),  # 8,000 + 14,878, rounded up
    (BIG_TASK, "adamw", {"nproc_per_node": 2}, 14878, 45800),
    (BIG_TASK, "sgd", {"nproc_per_node": 1}, 9919, 18000),
    (BIG_TASK, "adamw", {"nproc_per_node": 4, "nnodes": 2, "strategy": "fsdp"}, 1860, 39500),
    (BIG_TASK, "adamw", {"nproc_per_node": 4, "nnodes": 2, "strategy": "hsdp"}, 3720, 46900),
    (LOADING_TASK, "adamw", {"nproc_per_node": 1}, 0, 8000),  # not countable: the flat one
])  # fmt: skip
def test_a_gpu_runs_first_request_counts_what_its_checkpoints_pin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, task: str, optimizer: str,
    launch: dict[str, object], pinned: int, mem_mb: int,
) -> None:  # fmt: skip
    """Before its first slot a GPU run on SLURM asks for the flat 8,000 MB a process and what
    the process pins for its checkpoints: the model's parameters, counted on the meta device,
    and its optimizer's state (a 1.3B-parameter AdamW model: 15.6 GB more a process)."""
    monkeypatch.chdir(tmp_path)  # the workflow's working directory
    (tmp_path / "big.py").write_text(task)
    cfg = default_config()
    cfg.update(run="big", task="big.py", task_args={})
    cfg["train"]["optimizer"] = optimizer
    cfg["launch"].update(device="gpu", **launch)
    runs = Runs(config.validate(cfg), decide=lambda cfg: True)
    assert request.pinned_mb(runs.spec("big")) == pinned
    asked = request.train_resources(runs, on_slurm=True)["mem_mb"](wildcards(run="big"))
    assert asked == mem_mb
    flat = memory_request.GPU_PROCESS_MB * cfg["launch"]["nproc_per_node"]
    if task == BIG_TASK and optimizer == "adamw" and launch.get("strategy", "ddp") == "ddp":
        assert (asked - flat) * 2**20 >= 15.6e9 * cfg["launch"]["nproc_per_node"], asked
    state = StateDir(tmp_path / "results" / "big" / "state")  # once a slot measured: its peak
    state.root.mkdir(parents=True)
    attempts.save(state, [dataclasses.replace(slot(30000.0), world_size=launch["nproc_per_node"])])
    assert request.train_resources(runs, on_slurm=True)["mem_mb"](wildcards(run="big")) == 37500


def test_a_packed_gpu_allocation_counts_what_its_trials_checkpoints_pin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two one-GPU trials of the 1.3B-parameter AdamW model a node: 8,000 MB and the 14,878 MB
    pinned a trial (the flat 16,000 MB before: killed at the first checkpoint)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "big.py").write_text(BIG_TASK)
    cfg = default_config()
    cfg.update(run="big", task="big.py", task_args={})
    cfg["launch"].update(device="gpu", nproc_per_node=1)
    cfg["sweep"] = {"name": "s", "parameters": {"train.lr": [0.1]},
                    "pack": {"allocations": 1, "nodes": 1, "trials_per_node": 2}}  # fmt: skip
    found = sweep.from_config(config.validate(cfg))
    assert found is not None
    (trial,) = sweep.trials(found)
    spec = run_spec.resolve(sweep.apply(config.validate(cfg), found, trial), gpus=True)
    assert Allocation.of(spec).mem_mb == 45800  # 2 x (8,000 + 14,878), rounded up
    cfg["slurm"]["mem_mb"] = 30000  # a request of the user's own: as asked
    spec = run_spec.resolve(sweep.apply(config.validate(cfg), found, trial), gpus=True)
    assert Allocation.of(spec).mem_mb == 60000


def test_the_default_request_covers_the_default_runs_measured_peak_with_room() -> None:
    mem_mb = request.Request.from_spec(spec()).mem_mb
    assert 1.1 * DEFAULT_RUN_PEAK_MB < mem_mb < DEFAULT_RUN_PEAK_MB / 0.70  # no flag either way


def slot(peak_mb: float | None, world_size: int = 2, nodes: int = 1) -> Attempt:
    efficiency = None if peak_mb is None else {"memory_peak_mb": peak_mb}
    return Attempt(1, "7", 0, [f"cn{i}" for i in range(nodes)], 0.0, outcome="time limit",
                   efficiency=efficiency, world_size=world_size)  # fmt: skip


def test_later_jobs_ask_for_the_last_measured_peak_with_a_margin() -> None:
    req = request.Request.from_spec(spec())
    assert req.measured_mem_mb([]) == 3400  # nothing measured: the estimate
    assert req.measured_mem_mb([slot(2238.0)]) == 2800
    assert req.measured_mem_mb([slot(5000.0), slot(None)]) == 6300  # the last that measured
    assert req.measured_mem_mb([slot(5000.0, world_size=4, nodes=1)]) == 3400  # 4 a node then
    assert req.measured_mem_mb([slot(5000.0, world_size=4, nodes=2)]) == 6300  # 2 a node
    fixed = request.Request.from_spec(dataclasses.replace(
        spec(), slurm=dataclasses.replace(spec().slurm, mem_mb=4000)))  # fmt: skip
    assert fixed.measured_mem_mb([slot(5000.0)]) == 4000  # the user's request is kept
    killed = dataclasses.replace(
        slot(None),
        outcome="out of memory",
        mem_mb=2900,
        failure={"memory": {"kind": "host", "oom_killer": True}},
    )
    assert req.measured_mem_mb([slot(DEFAULT_RUN_PEAK_MB), killed]) == 3700  # more than 2900
    assert req.measured_mem_mb([dataclasses.replace(killed, mem_mb=None)]) == 3400  # unknown
    gpu = request.Request.from_spec(spec(nproc_per_node=2, device="gpu"))
    assert gpu.measured_mem_mb([slot(3000.0)]) == 8000  # never below a GPU process's least


def test_the_train_rule_asks_for_what_the_runs_state_folder_measured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the workflow's working directory
    runs = Runs(config.validate(default_config()), decide=lambda cfg: False)
    assert request.train_resources(runs)["mem_mb"](wildcards(run="mnist")) == 3400
    state = StateDir(tmp_path / "results" / "mnist" / "state")
    state.root.mkdir(parents=True)
    attempts.save(state, [slot(DEFAULT_RUN_PEAK_MB)])
    assert request.train_resources(runs)["mem_mb"](wildcards(run="mnist")) == 3400


def wildcards(**values: str) -> object:
    return type("Wildcards", (), values)()


@pytest.mark.parametrize(("field", "mb"), [
    ("2900M", 2900), ("4G", 4096), ("1.5G", 1536), ("2000", 2000), ("", None), ("0?", None),
])  # fmt: skip
def test_what_a_node_of_the_job_got(field: str, mb: int | None) -> None:
    assert memory_request.requested_mb({"MinMemoryNode": field}) == mb


def test_the_summary_judges_a_peak_against_the_request_of_its_own_job() -> None:
    """The last slot's job asked for 2,000 MB (an earlier default): its 2,668 MB peak is
    flagged against that, not against today's default."""
    measured = {"job": "7", "nodes": ["cn0"], "start": 0.0, "end": 900.0,
                "outcome": "completed", "mem_mb": 2000, "world_size": 2,
                "efficiency": {"memory_peak_mb": DEFAULT_RUN_PEAK_MB, "startup_s": 10.0,
                               "train_s": 800.0, "cpu_s": 1700.0}}  # fmt: skip
    lines = dict(slot_lines.efficiency(spec(), [measured]))
    assert "memory peak 2,668 MB a node of 2,000 MB" in lines["usage"]
    assert lines["waste"] == (
        "memory: the fullest node peaked at 2,668 MB, above the 2,000 MB requested (133%): a "
        "cluster that enforces the request (cgroup) kills the job there; ask for 3400 MB: "
        "`slurm.mem_mb: 3400` (or leave it null: the run's next job asks for its measured "
        "peak and a quarter)"
    )


# -- fitted to the partition's nodes ----------------------------------------------------------

ERROR = memory_request.MemoryRequestError


@pytest.mark.parametrize(("mb", "explicit", "node_mb", "per_node", "least", "asked"), [
    (2100, False, 4000, 2, 0, 4000),  # a packed sweep's 2 trials on 4,000 MB nodes: capped
    (6000, False, 4000, 1, 0, 4000),  # a 1-node run of 4 CPU processes: capped
    (3400, False, 4000, 1, 0, 3400),  # fits: as sized
    (2100, False, None, 2, 0, 4200),  # sinfo could not say: as sized
    (4000, True, 4000, 1, 0, 4000),  # slurm.mem_mb of the nodes' size: as set
    (16000, False, 12000, 1, 8000, 12000),  # 2 GPU processes: capped above their least
    (4200, True, 4000, 1, 0,
     "slurm.mem_mb 4,200 MB ask for 4,200 MB a node, but the partition's nodes have 4,000 MB "
     "(sinfo): sbatch would refuse it. Set slurm.mem_mb to 4000 or less, or to null"),
    (2100, True, 4000, 2, 0,
     "2 trials a node (sweep.pack.trials_per_node) of slurm.mem_mb 2,100 MB ask for 4,200 MB "
     "a node, but the partition's nodes have 4,000 MB (sinfo): sbatch would refuse it. Set "
     "slurm.mem_mb to 2000 or less, or sweep.pack.trials_per_node to 1, or to null"),
    (16000, False, 6000, 1, 8000,
     "the partition's nodes have 6,000 MB (sinfo), less than 1 slot(s) of GPU processes need "
     "at least (8,000 MB)"),
])  # fmt: skip
def test_a_request_fits_the_partitions_nodes(
    mb: int,
    explicit: bool,
    node_mb: int | None,
    per_node: int,
    least: int,
    asked: int | str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """(a slot's MB, slurm.mem_mb set or not, the nodes' MB, slots a node, a slot's least) ->
    the node's --mem, or the error before any sbatch; a cap is said."""
    if isinstance(asked, str):
        with pytest.raises(ERROR) as refused:
            memory_request.node_request_mb(mb, explicit, node_mb, per_node, least)
        assert asked in str(refused.value)
        return
    assert memory_request.node_request_mb(mb, explicit, node_mb, per_node, least) == asked
    capped = asked != mb * per_node
    said = f"memory request capped at the {asked:,} MB the partition's nodes have (sinfo)"
    assert (said in caplog.text) == capped


# `sinfo --Node --noheader --format=NODE_FORMAT` on tests/slurm_cluster.py's cluster (its nodes
# in both partitions, the default one marked), here with 4,000 MB nodes, and a site whose
# default partition mixes node sizes.
TEST_CLUSTER_SINFO = """\
node1 debug* 4000
node1 urgent 4000
node2 debug* 4000
node2 urgent 4000
"""
MIXED_SINFO = """\
cn01 cpu* 64000
cn02 cpu* 128000
cn03 cpu* 256000+
gpu1 gpu 512000
"""


@pytest.mark.parametrize(("text", "partition", "count", "node_mb"), [
    (TEST_CLUSTER_SINFO, None, 2, 4000),  # the default partition
    (TEST_CLUSTER_SINFO, "urgent", 1, 4000),
    (TEST_CLUSTER_SINFO, "other", 1, None),  # no such partition: not checked
    (MIXED_SINFO, None, 1, 256000),  # one node: the largest fits it
    (MIXED_SINFO, None, 2, 128000),  # two nodes: the second largest
    (MIXED_SINFO, None, 5, 64000),  # more than there are: the smallest
    (MIXED_SINFO, "gpu", 1, 512000),
    ("sinfo: error: ...\n", None, 1, None),
])  # fmt: skip
def test_the_nodes_memory_as_sinfo_says_it(
    text: str, partition: str | None, count: int, node_mb: int | None
) -> None:
    from ddppipe.slurm import sinfo

    assert sinfo.memory_mb(sinfo.parse_node_memory(text, partition), count) == node_mb
