"""The one record of bad nodes (ddppipe.slurm.bad_nodes), which a run's training job's
submission (the SLURM plugin's, ddppipe.slurm.executor.exclusions) reads: its format and the
cap. Quick: no cluster."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from ddppipe.launching import lifecycle, preflight
from ddppipe.runstate import attempts
from ddppipe.runstate.state import StateDir
from ddppipe.slurm import bad_nodes


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


@pytest.mark.parametrize("hosts", [["gpu1", "gpu2"], ["gpu2"]])
def test_a_run_records_no_node_when_every_node_failed(tmp_path: Path, hosts: list[str]) -> None:
    state = StateDir(tmp_path)
    plan = SimpleNamespace(job="41", hosts=hosts)
    run = SimpleNamespace(slurm=SimpleNamespace(max_excluded_nodes=2))
    error = preflight.PreflightError("every node failed", hosts)
    lifecycle._exclude_bad_nodes(run, plan, state, error)  # type: ignore[arg-type]
    assert not bad_nodes.of_run(state).path.exists() and attempts.load(state) == []
