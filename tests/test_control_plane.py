"""The control plane's scale model (bench/control_plane.py), small: its counts grow at most
linearly with the nodes and not at all with the ranks a node (N and 2N nodes, 2 and 8 ranks a
node), the real heartbeats, node summaries, watchdog, node watch and TCPStore counted."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.tiny import REPO


@pytest.fixture(scope="module")
def model() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "control_plane", REPO / "bench" / "control_plane.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["control_plane"] = module  # (its dataclass looks its module up)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("nodes", "ranks", "expected"),
    [
        # 10 s of steady training: each node's record written twice (every 5 s) and read 5
        # times (every 2 s), node-beats/ not listed (every rank's node known since the first
        # period): inotify's opens, the code's counts
        (2, 2, (14, 4, 10)),
        (2, 8, (14, 4, 10)),
        (4, 2, (28, 8, 20)),
        (4, 8, (28, 8, 20)),
    ],
)
def test_steady_training_opens_files_a_node_not_a_rank(
    model: ModuleType, tmp_path: Path, nodes: int, ranks: int, expected: tuple[int, int, int]
) -> None:
    assert model.steady_fs(tmp_path, nodes, ranks, 10.0) == expected


@pytest.mark.parametrize("nodes", [2, 4])
def test_slurm_is_asked_once_a_minute_whatever_the_nodes(
    model: ModuleType, tmp_path: Path, nodes: int
) -> None:
    assert model.slurm_calls_per_minute(tmp_path, nodes) == 1.0


@pytest.mark.parametrize(("world", "last"), [(4, 3), (16, 15)])
def test_the_node_checks_exchange_costs_each_rank_four_store_requests(
    model: ModuleType, world: int, last: int
) -> None:
    """Over a real TCPStore: set its mark, add to the count, wait, check the failing list;
    one rank (the one making the count whole, whichever) sets the all-reported key too."""
    counts = model.exchange_requests(world)
    assert sorted(counts) == [4] * last + [5]
