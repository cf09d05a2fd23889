"""A node's own checks before its processes join the training's world (ddppipe.parallel.
node_check), and the world's checks once joined (ddppipe.training.measuring.world_checks): in
this process, a real TCPStore standing in for torchrun's agent's; the GPU count stubbed (there
is no GPU here). The whole, on the two-node SLURM test cluster: tests/test_slurm.py and
tests/test_faults_head_and_node.py."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ddppipe.core import env_names, slot
from ddppipe.parallel import devices, distributed, node_check
from ddppipe.training.measuring import efficiency, world_checks
from tests import object_exchanges

ME = socket.gethostname()


def test_a_node_sees_the_state_folder_only_with_its_launchers_slot_record(
    tmp_path: Path,
) -> None:
    """The slot record is the token: a node that reads none (a shared filesystem not mounted)
    or an earlier slot's (a stale one) is named, with what it read."""
    record = slot.Slot("run", str(tmp_path), launcher="41:gpu1:100")
    env = slot.write(record, tmp_path / "slot.json")
    assert env[env_names.SLOT_LAUNCHER] == "41:gpu1:100"
    assert node_check.slot_problem(env) is None
    earlier = {**env, env_names.SLOT_LAUNCHER: "42:gpu1:200"}
    assert node_check.slot_problem(earlier) == (
        f"{ME}: does not see the run's state folder as the job's first node does "
        f"({tmp_path / 'slot.json'} is another slot's (41:gpu1:100, not 42:gpu1:200)): the "
        "shared filesystem is not mounted here, or stale; checkpoints and logs live there"
    )
    missing = {**env, env_names.SLOT: str(tmp_path / "elsewhere/slot.json")}
    problem = node_check.slot_problem(missing)
    assert problem and f"({tmp_path / 'elsewhere/slot.json'}: No such file" in problem
    assert node_check.slot_problem({}) is None  # no slot: a command by hand


def test_an_agent_names_its_node_when_the_rendezvous_host_does_not_resolve(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(env_names.SLOT, raising=False)
    (problem,) = node_check.agent_problems("no-such-host.invalid")
    assert problem.startswith(f"{ME}: cannot resolve the rendezvous host 'no-such-host.invalid'")
    assert node_check.agent_problems(ME) == []
    # an IPv6 rendezvous host in brackets, as torchrun's endpoint takes it: the address
    assert node_check.agent_problems("[::1]") == [] and node_check.host_problem("::1") is None


def test_an_agent_that_cannot_read_its_slot_record_names_its_node_and_ends(
    tmp_path: Path,
) -> None:
    """``ddppipe agent`` on a node without the run's state folder: its line and exit 3 in well
    under a second, before torch loads or the rendezvous (no slot record to read its stop
    signal from either)."""
    env = {**os.environ, env_names.SLOT: str(tmp_path / "not-here/slot.json"),
           env_names.SLOT_LAUNCHER: "41:gpu1:100"}  # fmt: skip
    agent = [sys.executable, "-m", "ddppipe", "agent", "--nnodes=2", "--nproc-per-node=1",
             "--rdzv-backend=c10d", "--rdzv-endpoint=no-such-host.invalid:29400",
             "-m", "x"]  # fmt: skip
    done = subprocess.run(agent, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == node_check.EXIT_CODE, done.stderr
    lines = done.stderr.splitlines()
    assert [line.split(": ")[2][:30] for line in lines] == [
        "cannot resolve the rendezvous ",
        "does not see the run's state f",
    ], lines
    assert node_check.failing_nodes(done.stderr, [ME]) == [ME]


def test_ranks_exchange_their_nodes_problems_before_any_exits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two ranks (threads) through the store torchrun's agent serves: each learns the other
    node's problem, so both refuse, and the node whose exit ends the step is not the only one
    named."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    found: dict[int, list[str] | None] = {}
    said = {0: [], 1: ["cn08: 2 process(es) need a GPU each and none is usable"]}

    def rank(r: int) -> None:
        found[r] = node_check._exchanged(said[r], r, 2, 30)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert found == {0: {1: said[1]}, 1: {1: said[1]}}
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # another launcher: no store
    assert node_check._exchanged(said[1], 1, 2, 30) is None


class Counted:
    """A store's client that counts its requests."""

    def __init__(self, store: Any) -> None:
        self.store, self.requests = store, 0

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.store, name)

        def counted(*args: Any) -> Any:
            self.requests += 1
            return method(*args)

        return counted


@pytest.mark.parametrize("world", [4, 8])
def test_the_exchange_asks_the_store_a_few_times_a_rank_whatever_the_world(world: int) -> None:
    """Each of ``world`` ranks (threads, a client each) through a real TCPStore: every rank
    learns the two failing ranks' problems in 7 requests (a fit rank) or 9 (a failing one),
    and the one that made the count whole one more, at 4 ranks as at 8 (it was a request per
    rank of the world for every rank: world²)."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    failing = {1: ["cn01: GPU 0 is not usable"], 3: ["cn03: GPU 1 is not usable"]}
    found: dict[int, dict[int, list[str]]] = {}
    asked: dict[int, int] = {}

    def rank(r: int) -> None:
        client = dist.TCPStore("127.0.0.1", server.port, is_master=False)
        store = Counted(dist.PrefixStore("ddppipe/node-check/0/", client))
        found[r] = node_check.exchange(store, failing.get(r, []), r, world, 60)
        asked[r] = store.requests

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert found == {r: failing for r in range(world)}
    over = {r: n - (9 if r in failing else 7) for r, n in asked.items()}
    assert sorted(over.values()) == [0] * (world - 1) + [1], asked


def _rank_of_two(monkeypatch: pytest.MonkeyPatch, rank: int) -> dist.TCPStore:
    """This process as rank ``rank`` of a torchrun world of 2 on one node; its agent's store."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "RANK": str(rank),
           "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
           "TORCHELASTIC_USE_AGENT_STORE": "True"}  # fmt: skip
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return store


def _said(err: str) -> list[str]:
    """The node-check lines of stderr (not torch's store warnings)."""
    return [line for line in err.splitlines() if line.startswith(node_check.PREFIX)]


def test_a_problem_only_a_later_local_rank_found_is_said_once(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """Local rank 0 found its node fit, local rank 1 (a GPU failing between their checks) did
    not: rank 1 says it (the launcher names the node from that line only); a problem rank 0
    found and said already is not said again."""
    problem = f"{ME}: GPU 1 (X) is not supported by torch"
    monkeypatch.setattr(node_check, "device_check", lambda *a: ("", [problem]))
    for rank_0, said in (([], [f"preflight: {problem}"]), ([problem], [])):
        store = _rank_of_two(monkeypatch, 1)
        reported = dist.PrefixStore("ddppipe/node-check/0/", store)  # (rank 0's report)
        if rank_0:
            reported.set("0", json.dumps(rank_0))
            reported.append("failing", "0,")
        reported.set("reported/0", "")
        reported.add("reported", 1)
        with pytest.raises(node_check.NodeUnfit, match=r"GPU 1 \(X\) is not supported"):
            node_check.before_joining("gpu", "fp32", 30)
        err = capfd.readouterr().err
        assert _said(err) == said
    assert node_check.failing_nodes(f"preflight: {problem}", ["cn07", ME]) == [ME]


def test_ranks_that_never_report_their_checks_are_named(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """Rank 1 of 2 never answers: rank 0 stops after the timeout naming it (not torch's store
    timeout); a rank with a problem of its own names that instead, said on stderr."""
    store = _rank_of_two(monkeypatch, 0)
    monkeypatch.setattr(node_check, "device_check", lambda *a: ("", []))
    with pytest.raises(node_check.NodeUnfit) as raised:
        node_check.before_joining("gpu", "fp32", 1)
    assert str(raised.value) == (
        f"{ME} rank 0: rank(s) 1 of 2 did not report their node's checks within 1 s: their "
        "processes failed or hang before joining (their node's lines and the step's stderr "
        "say which)"
    )
    problem = f"{ME}: 2 process(es) need a GPU each and none is usable"
    monkeypatch.setattr(node_check, "device_check", lambda *a: ("", [problem]))
    store = _rank_of_two(monkeypatch, 1)  # rank 0 silent
    with pytest.raises(node_check.NodeUnfit, match="^" + re.escape(problem) + "$"):
        node_check.before_joining("gpu", "fp32", 1)
    assert _said(capfd.readouterr().err) == [f"preflight: {problem}"]
    del store


def test_gpus_that_cannot_be_used_are_refused_before_joining(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """A GPU run's rank on a node whose CUDA build sees no device (the count stubbed): its
    node's line on stderr, for the launcher, and NodeUnfit before any process group."""
    monkeypatch.setattr(torch.version, "cuda", torch.version.cuda or "13.0")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.setenv(name, "1" if "SIZE" in name else "0")
    with pytest.raises(node_check.NodeUnfit, match="need a GPU each and none is usable"):
        node_check.before_joining("gpu", "fp32", 30)
    err = capfd.readouterr().err
    assert err.startswith(f"preflight: {ME}: 1 process(es) need a GPU each and none is usable")
    assert node_check.failing_nodes(err, ["cn07", ME]) == [ME]
    assert not dist.is_initialized()
    node_check.before_joining("cpu", "fp32", 30)  # a CPU run: nothing to refuse


def test_the_worlds_checks_on_a_world_of_one() -> None:
    """All-reduce checked, no peer to measure, this node's GEMM peak; rank 0's figures and the
    time they took, as a checked slot records them."""
    ctx = distributed.Context(0, 0, 1, torch.device("cpu"), "gloo", "single", 1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        meter = efficiency.SlotMeter()
        peak = world_checks.in_slot(ctx, "fp32", meter)
    finally:
        dist.destroy_process_group()
    assert peak is not None and peak["precision"] == "fp32" and list(peak["gflops"]) == [ME]
    assert peak["gflops"][ME] > 0.1
    assert 0.5 <= meter.seconds["checks"] < 30  # (the GEMM alone measures for 0.5 s)
    assert world_checks.bus_bandwidth(16 * 2**20, 4, 0.01) == pytest.approx(2.52e9, rel=0.01)


@pytest.mark.parametrize(
    ("nodes", "rounds"),
    [
        (1, []),
        (2, [[(0, 1)]]),
        (3, [[(0, 1)], [(1, 2)], [(0, 2)]]),  # every pair, as before
        (4, [[(0, 1), (2, 3)], [(1, 2), (0, 3)]]),
        (5, [[(0, 1), (2, 3)], [(1, 2), (3, 4)], [(0, 4)]]),
    ],
)
def test_the_world_checks_time_each_node_with_its_ring_neighbours_in_rounds(
    nodes: int, rounds: list[list[tuple[int, int]]]
) -> None:
    assert world_checks.ring_rounds(nodes) == rounds


def test_a_ring_of_any_size_has_a_pair_a_node_in_at_most_3_rounds() -> None:
    for nodes in (6, 7, 64, 511, 2048):
        rounds = world_checks.ring_rounds(nodes)
        pairs = [pair for r in rounds for pair in r]
        assert len(rounds) <= 3 and len(pairs) == len(set(pairs)) == nodes
        for r in rounds:  # no node in two pairs of a round: they run at once
            members = [node for pair in r for node in pair]
            assert len(members) == len(set(members))
        assert {node for pair in pairs for node in pair} == set(range(nodes))


def test_each_rank_is_sent_its_pair_a_round_and_the_pairs_ranks() -> None:
    ab, bc, ac = ((0, 1), [0, 1, 2, 3]), ((1, 2), [2, 3, 4]), ((0, 2), [0, 1, 4])
    none = (None, [])
    plans = world_checks.pair_plans(["a", "a", "b", "b", "c"])
    assert plans == [[ab, none, ac], [ab, none, ac], [ab, bc, none], [ab, bc, none],
                     [none, bc, ac]]  # fmt: skip
    assert world_checks.pair_plans(["a", "b", "a"]) == [[((0, 1), [0, 1, 2])]] * 3
    assert world_checks.pair_plans(["a", "a"]) == [[], []]  # one node: no pair to time


def test_ranks_sharing_a_gpu_are_named_by_node() -> None:
    assert distributed.shared_gpu([("cn00", "GPU-a"), ("cn00", "GPU-b")]) is None
    assert distributed.shared_gpu([("cn00", "GPU-a"), ("cn01", "GPU-a")]) is None  # 2 nodes
    assert distributed.shared_gpu([("cn00", "GPU-a"), ("cn01", "GPU-b"), ("cn01", "GPU-b")]) == (
        "cn01: ranks [1, 2] share one GPU (GPU-b); each process needs its own: set "
        "launch.nproc_per_node to the node's GPUs"
    )


def test_a_pair_far_below_the_median_is_named_slow() -> None:
    gbs = {"a<->b": 10e9, "b<->c": 9e9, "c<->d": 4e9, "a<->d": 11e9}
    assert world_checks.slow_pairs(gbs) == ["c<->d at 40% of the median"]
    assert world_checks.slow_pairs({"a<->b": 10e9, "b<->a": 1e9}) == []  # (no median of 2)


def _ring_rank(rank: int, world: int, folder: str) -> None:
    """A rank of ``world`` alone on its node (its own host name as the checks see it)."""
    import types

    world_checks.socket = types.SimpleNamespace(gethostname=lambda: f"cn{rank:02d}")  # type: ignore[assignment]
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank,
                            world_size=world)  # fmt: skip
    ctx = distributed.Context(rank, 0, world, torch.device("cpu"), "gloo", "test", 1)
    with object_exchanges.counted() as calls:
        report = world_checks.run(ctx, "fp32")
    if rank == 0:
        Path(folder, "line").write_text(report.line)
    # the same 3 ranks as one node's with GPUs, ranks 1 and 2 on the same one (stubbed)
    distributed.socket = types.SimpleNamespace(gethostname=lambda: "cn00")  # type: ignore[assignment]
    uuid = ["GPU-a", "GPU-b", "GPU-b"][rank]
    torch.cuda.get_device_properties = lambda _: types.SimpleNamespace(uuid=uuid)  # type: ignore[assignment]
    with object_exchanges.counted() as gpu_calls:
        try:
            distributed.check_distinct_gpus(torch.device("cuda", 0))
            refused = ""
        except devices.DeviceError as e:
            refused = str(e)
    found = {"calls": calls, "gpu_calls": gpu_calls, "refused": refused}
    Path(folder, f"calls-{rank}.json").write_text(json.dumps(found))
    dist.destroy_process_group()


def test_three_nodes_time_their_ring_pairs_in_rounds_of_their_own(tmp_path: Path) -> None:
    """3 ranks on 3 nodes (processes of their own): each round's pair makes its
    group alone (a node outside it makes one of itself, so that torch names the next round's
    groups alike on both of its ranks: without that, the second round hung) and every pair's
    bus bandwidth is in rank 0's line. No rank gets every rank's host: rank 0 gathers them
    and sends each rank its pairs. The same 3 ranks as one node's, two of them on one GPU
    (stubbed): every rank refuses to start, told by rank 0, which alone got every rank's GPU."""
    import torch.multiprocessing as mp

    mp.spawn(_ring_rank, args=(3, str(tmp_path)), nprocs=3)  # (a fork of this one may hang)
    line = (tmp_path / "line").read_text()
    pairs = "; ".join(rf"{pair}: [\d.]+ GB/s" for pair in ("cn00<->cn01", "cn00<->cn02",
                                                          "cn01<->cn02"))  # fmt: skip
    assert re.search(rf"world \(3 ranks\): [\d.]+ GB/s; {pairs}; GEMM peak", line), line
    # hosts, pairs' figures and peaks to rank 0 alone; each rank sent its own pairs to time
    found = [json.loads((tmp_path / f"calls-{r}.json").read_text()) for r in range(3)]
    assert [f["calls"] for f in found] == [
        {"gather_object": 3, "gather_object:received": 9, "scatter_object_list": 1,
         "scatter_object_list:received": 1},
        *[{"gather_object": 3, "gather_object:received": 0, "scatter_object_list": 1,
           "scatter_object_list:received": 1}] * 2,
    ]  # fmt: skip
    # two ranks of a node on one GPU: every rank refuses, told by rank 0
    assert [f["refused"] for f in found] == [
        "cn00: ranks [1, 2] share one GPU (GPU-b); each process needs its own: set "
        "launch.nproc_per_node to the node's GPUs"
    ] * 3
    assert [f["gpu_calls"] for f in found] == [
        {"gather_object": 1, "gather_object:received": 3, "broadcast_object_list": 1,
         "broadcast_object_list:received": 1},
        *[{"gather_object": 1, "gather_object:received": 0, "broadcast_object_list": 1,
           "broadcast_object_list:received": 1}] * 2,
    ]  # fmt: skip
