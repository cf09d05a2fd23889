"""The SLURM plugin's node exclusions keep node names only (its issue #485)."""

from __future__ import annotations

from snakemake_executor_plugin_slurm import Executor

from ddppipe.slurm import bad_nodes
from ddppipe.slurm.executor import failed_node_names


def test_placeholders_are_no_node_names() -> None:
    assert [bad_nodes.is_node_name(v) for v in (
        "cn07", "gpu-a[01-04]", "node1,node2", "None assigned", "None", "", " cn07",
    )] == [True, True, True, False, False, False, False]  # fmt: skip


def test_the_plugins_executor_excludes_only_node_names() -> None:
    # a subclass: the plugin's own class stays as it is for the other tests of this process
    cls = type("Executor", (Executor,), {})
    made_before = object.__new__(cls)  # as __post_init__ leaves it, without a workflow
    made_before.__dict__["_failed_nodes"] = {"cn07", "None assigned"}
    failed_node_names.install(cls)
    failed_node_names.install(cls)  # twice: the same
    made_before._failed_nodes.add("None assigned")  # sacct's answer for a requeued job
    made_before._failed_nodes.add("cn08")
    assert made_before._failed_nodes == {"cn07", "cn08"}
    made_after = object.__new__(cls)
    made_after._failed_nodes = set()  # what the plugin's __post_init__ does
    made_after._failed_nodes.add("None assigned")
    assert made_after._failed_nodes == set()
