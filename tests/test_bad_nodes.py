"""The one record of bad nodes (ddppipe.slurm.bad_nodes), which a run's training job's
submission (the SLURM plugin's, ddppipe.slurm.executor.exclusions) and a packed sweep's
allocations (ddppipe.packing.allocation) both read: its format, the cap, and both paths reading
what the other wrote. Quick: no cluster."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from ddppipe.core import atomic
from ddppipe.launching import launch, lifecycle, preflight, slot_machine
from ddppipe.packing import allocation
from ddppipe.packing.allocation import Allocation
from ddppipe.packing.pool import Pool
from ddppipe.packing.tickets import Ticket
from ddppipe.runstate import attempts
from ddppipe.runstate.state import StateDir
from ddppipe.slurm import bad_nodes
from ddppipe.slurm.executor import exclusions, failed_node_names
from tests.test_packing import packed_spec


def test_bad_nodes_are_excluded_within_the_cap() -> None:
    hosts = ["cn07", "cn08", "cn09"]
    first = bad_nodes.decide(["cn08"], hosts, [], 2)
    assert first.excluded == ["cn08"]
    assert first.reason == (
        "cn08 failed the preflight: excluded from the next slot (1 of "
        "slurm.max_excluded_nodes 2 excluded: cn08)"
    )
    assert bad_nodes.decide(["cn09"], hosts, ["cn08"], 2).excluded == ["cn08", "cn09"]
    capped = bad_nodes.decide(["cn09"], hosts, ["cn08"], 1)
    assert capped.excluded == []
    assert capped.reason == (
        "cn09 failed the preflight and slurm.max_excluded_nodes (1) is reached (excluded so "
        "far: cn08): repair the nodes or raise it"
    )
    every = bad_nodes.decide(hosts, hosts, [], 2)  # the run's problem, not a node's
    assert every.excluded == [] and "every node of the slot failed" in every.reason
    assert bad_nodes.decide([], hosts, [], 2).excluded == []
    # a pool's node checks itself alone: the only node of an allocation is still a bad node
    alone = bad_nodes.decide(["cn07"], None, [], 2, bad_nodes.NEXT_ALLOCATIONS)
    assert alone == bad_nodes.Decision(
        ["cn07"],
        "cn07 failed the preflight: excluded from the pool's next allocations (1 of "
        "slurm.max_excluded_nodes 2 excluded: cn07)",
    )


def test_the_record_survives_in_its_folder_and_keeps_node_names_only(tmp_path: Path) -> None:
    record = bad_nodes.of_run(StateDir(tmp_path))
    assert record.path == tmp_path / "excluded-nodes.json"  # the file of earlier releases
    assert record == Pool(tmp_path).bad_nodes  # a pool's is the same file in its folder
    assert record.load() == [] and record.exclude() is None
    record.save(["gpu2", "gpu5"])
    assert json.loads(record.path.read_text()) == ["gpu2", "gpu5"]
    assert record.load() == ["gpu2", "gpu5"] and record.exclude() == "gpu2,gpu5"
    record.path.write_text('["gpu2", "None assigned", "(null)", "gpu-a[01-02]"]')  # by hand
    assert record.exclude() == "gpu2,gpu-a[01-02]"
    record.path.write_text('{"gpu2": 1}')
    assert record.load() == []
    record.path.write_text("not json")
    assert record.load() == []


class _Job:
    """What the executor's submission reads of a Snakemake job."""

    name = "train"

    def is_group(self) -> bool:
        return False


def _executor(state: StateDir) -> Any:
    """An executor class with the plugin's exclusions (``_failed_nodes``, which it passes to
    ``sbatch --exclude``) and ddppipe's submission wrapper; its submission records them."""

    class Executor:
        logger = logging.getLogger("test_bad_nodes")

        def run_job(self, job: Any) -> None:
            self.excluded = ",".join(sorted(self._failed_nodes))

    failed_node_names.install(Executor)
    assert exclusions.install(Executor, lambda job: state)
    made = Executor()
    made._failed_nodes = set()  # what the plugin's __post_init__ does
    return made


def _node_failed(pool: Pool, job: str, node: str) -> None:
    """What a pack-worker whose node fails its preflight records (ddppipe.packing.worker)."""
    atomic.write_json(pool.allocations / "nodes" / f"{job}-{node}.json",
                      {"job": job, "node": node, "slots": 1, "started": 1.0, "ended": 2.0,
                       "preflight": ["no usable GPU"], "slot_records": []})  # fmt: skip


def test_both_paths_read_one_record(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A node the launcher records (a run's failed preflight) is in a packed allocation's
    ``--exclude``, and one a pool's allocation found bad is in the training job's submission:
    one format, one reader. (One folder plays a run's state folder and a pool here: each
    keeps its record in ``excluded-nodes.json`` of its own folder.)"""
    folder = tmp_path / "results/sweeps/s/pack"
    state, pool = StateDir(folder), Pool(folder)
    spec = packed_spec(tmp_path, launch={"nnodes": 1, "device": "cpu"})
    held = Allocation.of(spec)
    # the executor path: the launcher records gpu2, whose agent failed its node's check
    slot = slot_machine.SlotState("41", True, ("gpu1", "gpu2"), max_excluded_nodes=2)
    attempts.begin(state, "41", 0, list(slot.hosts))  # the slot's attempt, open as its ranks start
    said = ("preflight: gpu2: does not see the run's state folder as the job's first node does",)
    with pytest.raises(preflight.PreflightError, match="gpu2: does not see the run's") as raised:
        lifecycle._end(spec, slot, state, launch.Ended(1, None, list(said)))
    assert raised.value.nodes == ["gpu2"]
    (attempt,) = attempts.load(state)
    assert (attempt.outcome, attempt.exit_status) == ("bad node gpu2", 1)
    assert attempt.detail == (
        "gpu2 failed the preflight: excluded from the next slot (1 of slurm.max_excluded_nodes "
        "2 excluded: gpu2)"
    )
    submitted = _executor(state)
    caplog.set_level(logging.INFO, logger="test_bad_nodes")
    submitted.run_job(_Job())
    assert submitted.excluded == "gpu2"
    assert (
        "ddppipe: excluding gpu2 from SLURM submissions of rule train: recorded bad by its run "
        f"(failed its checks, or lost mid-step: {state.excluded_nodes})"
    ) in caplog.messages
    assert "--exclude=gpu2" in held.sbatch(pool, "/wd")
    # the packing path: gpu5 fails its preflight in an allocation of the pool
    _node_failed(pool, "42", "gpu5")
    decision = allocation.exclude_bad_nodes(pool, spec.slurm.max_excluded_nodes)
    assert decision == bad_nodes.Decision(
        ["gpu2", "gpu5"],
        "gpu5 failed the preflight: excluded from the pool's next allocations (2 of "
        "slurm.max_excluded_nodes 2 excluded: gpu2, gpu5)",
    )
    assert "--exclude=gpu2,gpu5" in held.sbatch(pool, "/wd")
    again = _executor(state)
    again.run_job(_Job())
    assert again.excluded == "gpu2,gpu5"
    assert json.loads((folder / "excluded-nodes.json").read_text()) == ["gpu2", "gpu5"]


def test_a_pools_exclusions_are_capped_as_a_runs(tmp_path: Path) -> None:
    """Past ``slurm.max_excluded_nodes`` the pool excludes no more nodes and its waiting
    trials are refused (their train jobs fail, saying why), as a run fails; each failure is
    decided once, and deleting the record ends the exclusions."""
    pool = Pool(tmp_path / "results/sweeps/s/pack")
    spec = packed_spec(tmp_path, launch={"nnodes": 1, "device": "cpu"})
    held = Allocation.of(spec)
    pool.put(Ticket("sweeps/s/a"))
    _node_failed(pool, "42", "gpu5")
    assert allocation.exclude_bad_nodes(pool, 1).excluded == ["gpu5"]  # type: ignore[union-attr]
    assert allocation.exclude_bad_nodes(pool, 1) is None  # decided once
    assert pool.waiting() == 1
    _node_failed(pool, "43", "gpu6")
    capped = allocation.exclude_bad_nodes(pool, 1)
    why = (
        "gpu6 failed the preflight and slurm.max_excluded_nodes (1) is reached (excluded so "
        "far: gpu5): repair the nodes or raise it"
    )
    assert capped == bad_nodes.Decision([], why)
    assert pool.waiting() == 0 and pool.refusal("sweeps/s/a") == why
    assert "--exclude=gpu5" in held.sbatch(pool, "/wd")
    assert allocation.exclude_bad_nodes(pool, 1) is None
    pool.bad_nodes.path.unlink()  # the nodes repaired
    assert not any(a.startswith("--exclude") for a in held.sbatch(pool, "/wd"))


@pytest.mark.parametrize("hosts", [["gpu1", "gpu2"], ["gpu2"]])
def test_a_run_records_no_node_when_every_node_failed(tmp_path: Path, hosts: list[str]) -> None:
    """Every node of the slot failed its check (each said so, twice: its two ranks): a problem
    of the run, not of a node; the slot's attempt says so, no node is recorded."""
    state = StateDir(tmp_path)
    slot = slot_machine.SlotState("41", True, tuple(hosts), max_excluded_nodes=2)
    attempts.begin(state, "41", 0, hosts)
    said = [f"preflight: {h}: 2 process(es) need a GPU each and none is usable" for h in hosts]
    spec = packed_spec(tmp_path, launch={"nnodes": 1, "device": "cpu"})  # (not read here)
    with pytest.raises(preflight.PreflightError) as raised:
        lifecycle._end(spec, slot, state, launch.Ended(3, None, said * 2))
    assert raised.value.nodes == hosts
    assert str(raised.value).count("none is usable") == len(hosts)  # each node's once
    assert not bad_nodes.of_run(state).path.exists()
    (attempt,) = attempts.load(state)
    assert attempt.outcome == f"failed its checks ({', '.join(hosts)})"
    assert attempt.detail.startswith("every node of the slot failed"), attempt.detail
