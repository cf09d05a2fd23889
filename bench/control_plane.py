"""A scale model of ddppipe's control plane: its load on the shared filesystem, the job's
store and the SLURM controller, and its share of a slot's start-up, at N nodes of R ranks.

The real code runs, with nodes and ranks that do not train:

- **steady training, the shared filesystem**: every rank's heartbeat
  (:class:`ddppipe.training.measuring.heartbeat.Heart`, node-local), each node's summary
  (:class:`ddppipe.training.measuring.node_summary.Summary`), and the launcher's hang watchdog
  (:class:`ddppipe.launching.watchdog.Watchdog`) and node watch
  (:class:`ddppipe.launching.node_watch.NodeWatch`) reading the nodes' records, on a simulated
  clock (``--seconds`` of steady training after one report period), the shared state folder
  watched by inotify (bench/fs_ops.py): its opens, creates, deletes and renames a second;
- **SLURM**: the node watch's ``scontrol show node`` calls a minute over 10 simulated minutes
  (counted, scontrol itself not run; at N or :data:`SLURM_NODES` nodes, the fewer: the calls
  do not depend on the nodes, one call asks about them all);
- **the store at start-up**: the node checks' exchange
  (:func:`ddppipe.parallel.node_check.exchange`) of N x R ranks as threads over a real TCPStore,
  its requests counted, up to ``--store-ranks`` ranks; beyond, each rank's count measured there
  times the ranks (it does not change with the world, which the model checks);
- **the start-up's critical path** (modelled, not run): the exchange's requests one after
  another at the store (its server serves one at a time) at the cost of one request measured
  here, plus the world checks' rounds (:func:`ddppipe.training.measuring.world_checks.ring_rounds`)
  at ``--round-s`` each (an assumption: a pair's 16 MiB all-reduces and its group's creation);
- **a DDP checkpoint**: the files one save writes, the job's and a node's, and the copies of
  the model's and optimizer's state a node holds in host memory for it
  (:func:`ddppipe.training.checkpoints.save_plan.ddp`: rank 0 alone copies and writes the state,
  each rank its own RNG file).

Before: the code of commit f4c52e7, modelled from its operations (not run): each rank wrote
its heartbeat file and the launcher read it every second (2 opens a second a rank), each node's
agent wrote its beat file every second and the node watch read it (2 a node), and listed
``failures/`` every second (1 a job); ``scontrol`` every 15 s; the exchange read every rank's
key from every rank (world x (world + 2) requests); the world checks timed every pair of nodes
one after another; a DDP save copied the state on every rank and wrote it in parts from all
(a file a rank, 3 more on the first node: ``docs/performance.md``'s count).

    python bench/control_plane.py                    # N = 8, 64, 512, 2048; 8 ranks a node
    python bench/control_plane.py --nodes 8 64 --json out.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # (c10d's warning a client, unresolved)

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from fs_ops import METADATA, Watcher  # noqa: E402

from ddppipe.launching import node_watch, watchdog  # noqa: E402
from ddppipe.launching.node_records import NodeRecords  # noqa: E402
from ddppipe.runstate import node_beats  # noqa: E402
from ddppipe.runstate.state import StateDir  # noqa: E402
from ddppipe.settings import run_spec  # noqa: E402
from ddppipe.training.checkpoints import save_plan  # noqa: E402
from ddppipe.training.measuring import heartbeat, node_summary, world_checks  # noqa: E402
from tests.tiny import default_config  # noqa: E402

LAUNCHER = "9:cn0:1/1"
TICK_S = 0.5  # the simulated clock's step: the ranks' writes and the summaries' polls
OLD_SCONTROL_EVERY_S = 15.0
SLURM_NODES = 64  # the most nodes whose records the SLURM count writes for 10 minutes


@dataclass
class Figures:
    """The model's figures at ``nodes`` x ``ranks``."""

    nodes: int
    ranks: int
    fs_ops_per_s: float  # shared-filesystem metadata operations a second, steady training
    fs_ops_per_s_per_node: float
    record_writes: int  # the nodes' records written in the steady window (inotify: creates
    record_reads: int  # and opens of node-beats/*; the readers' own count)
    slurm_calls_per_min: float
    store_requests: int  # the node checks' exchange, all ranks
    store_requests_per_rank: float
    store_measured: bool  # run over the TCPStore (else each rank's measured count x ranks)
    check_rounds: int
    startup_s: float  # modelled: the exchange's requests in sequence + the checks' rounds
    ckpt_files: int  # one DDP save's, the job's
    ckpt_files_node: int  # on a node but the first
    ckpt_copies_first_node: int  # copies of the state in host memory: on the first node
    ckpt_copies_node: int  # on each other


def spec_of(ranks: int, nodes: int) -> run_spec.RunSpec:
    cfg = default_config()
    cfg["launch"].update(nnodes=nodes, nproc_per_node=ranks)
    cfg["train"].update(batch_size=16 * nodes * ranks)  # (the global batch: the world's multiple)
    return run_spec.resolve(cfg, False)


def steady_fs(root: Path, nodes: int, ranks: int, seconds: float) -> tuple[int, int, int]:
    """Steady training's metadata operations on the shared state folder in ``seconds``
    (simulated), and of them the records written and read: the real heartbeats, summaries,
    watchdog and node watch, driven by a simulated clock."""
    state, local_root = StateDir(root / "shared" / "state"), root / "node-local"
    state.root.mkdir(parents=True)
    spec = spec_of(ranks, nodes)
    dog = watchdog.Watchdog(spec, state, 1, "9", nodes * ranks)
    dog.environment()
    hosts = [f"cn{n}" for n in range(nodes)]
    dog.records = NodeRecords(state.node_beats, LAUNCHER, hosts, started=0.0)
    watch = node_watch.NodeWatch(state, "9", hosts, dog.records)
    watch.begin(LAUNCHER, now=0.0)
    watch._slurm_failed = lambda: {}  # type: ignore[method-assign]  # (counted, not run)
    hearts, summaries = [], []
    for n, host in enumerate(hosts):
        local = local_root / host
        local.mkdir(parents=True)
        for r in range(ranks):
            heart = heartbeat.Heart(local, n * ranks + r, True, False, background=False)
            hearts.append(heart)
        summaries.append(node_summary.Summary(LAUNCHER, host, local, state, "auto", now=0.0))

    def tick(t: float, step: int) -> None:
        for heart in hearts:
            heart.beat(heartbeat.STEP, step)
            heart._write()
        for summary in summaries:
            summary.step(t)
        dog._check(t)
        watch.check(t)

    t, step = 0.0, 0
    while t < node_summary.REPORT_S:  # the first period: every record written once
        tick(t, step)
        t, step = t + TICK_S, step + 1
    writes_before, reads_before = sum(s.writes for s in summaries), dog.records.opens
    with Watcher(state.root) as watcher:
        end_t = t + seconds
        while t < end_t:
            tick(t, step)
            t, step = t + TICK_S, step + 1
    counted = [e for e in watcher.events if e.kind in METADATA]
    writes = sum(s.writes for s in summaries) - writes_before
    reads = dog.records.opens - reads_before
    assert not [e for e in counted if not e.path.startswith("node-beats")], counted[:5]
    return len(counted), writes, reads


def slurm_calls_per_minute(root: Path, nodes: int, minutes: int = 10) -> float:
    """The node watch's scontrol calls a minute, every node reporting every REPORT_S."""
    state = StateDir(root / "slurm" / "state")
    hosts = [f"cn{n}" for n in range(nodes)]
    watch = node_watch.NodeWatch(state, "9", hosts)
    watch.begin(LAUNCHER, now=0.0)
    watch._slurm_failed = lambda: {}  # type: ignore[method-assign]
    state.node_beats.mkdir(parents=True)
    t, count = 0.0, 0
    while t <= minutes * 60:
        if t % node_summary.REPORT_S == 0:
            count += 1
            for host in hosts:
                node_beats.NodeRecord(LAUNCHER, host, count).write(state.node_beats / host)
        watch.check(now=t)
        t += 1.0
    return watch.slurm_calls / minutes


class Counting:
    """A store whose requests are counted."""

    def __init__(self, store: Any) -> None:
        self.store, self.requests = store, 0

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.store, name)

        def request(*args: Any, **kwargs: Any) -> Any:
            self.requests += 1
            return method(*args, **kwargs)

        return request


def exchange_requests(world: int) -> list[int]:
    """Each rank's store requests in the node checks' exchange of ``world`` ranks (threads,
    each with its own client of a real TCPStore; no rank with a problem)."""
    import torch.distributed as dist

    from ddppipe.parallel import node_check

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    counts = [0] * world
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            client = dist.TCPStore("127.0.0.1", server.port, is_master=False,
                                   timeout=datetime.timedelta(seconds=120))  # fmt: skip
            store = Counting(dist.PrefixStore("ddppipe/node-check/0/", client))
            assert node_check.exchange(store, [], r, world, 120) == {}
            counts[r] = store.requests
        except BaseException as e:  # (named below)
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return counts


def request_seconds(requests: int = 2000) -> float:
    """One store request's cost at a real TCPStore (one client, one after another)."""
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False)
    started = time.perf_counter()
    for _ in range(requests):
        client.add("n", 1)
    return (time.perf_counter() - started) / requests


def model(nodes: int, ranks: int, seconds: float, store_ranks: int, per_request_s: float,
          round_s: float, per_rank: dict[int, float]) -> Figures:  # fmt: skip
    """The figures at ``nodes`` x ``ranks``; ``per_rank``: each world's measured requests a
    rank so far (the largest measured one stands for larger worlds)."""
    root = Path(tempfile.mkdtemp(prefix="ddppipe-control-plane-"))
    try:
        ops, writes, reads = steady_fs(root, nodes, ranks, seconds)
        slurm = slurm_calls_per_minute(root, min(nodes, SLURM_NODES))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    world = nodes * ranks
    measured = world <= store_ranks
    if measured or not per_rank:
        size = world if measured else store_ranks
        per_rank[size] = sum(exchange_requests(size)) / size
    rate = per_rank[world] if measured else per_rank[max(per_rank)]
    requests = round(rate * world)
    rounds = len(world_checks.ring_rounds(nodes))
    plan = save_plan.ddp(nodes, ranks, 1)
    return Figures(
        nodes, ranks, round(ops / seconds, 2), round(ops / seconds / nodes, 3), writes, reads,
        slurm, requests, round(rate, 2), measured, rounds,
        round(requests * per_request_s + rounds * round_s, 2), plan.files,
        plan.busiest_node_files - len(save_plan.RANK0_FILES),
        int(plan.pinned_bytes_node_0 > 0), int(plan.pinned_bytes_other_nodes > 0),
    )  # fmt: skip


def before(nodes: int, ranks: int, per_request_s: float, round_s: float) -> dict[str, float]:
    """Commit f4c52e7's figures (modelled from its operations: the module's docstring)."""
    world = nodes * ranks
    per_s = 2 * world + 2 * nodes + 1
    pairs = nodes * (nodes - 1) // 2
    requests = world * (world + 2)
    return {
        "fs_ops_per_s": per_s, "fs_ops_per_s_per_node": round(per_s / nodes, 3),
        "slurm_calls_per_min": 60 / OLD_SCONTROL_EVERY_S, "store_requests": requests,
        "startup_s": round(requests * per_request_s + pairs * round_s, 1),
        "ckpt_files": world + 3, "ckpt_files_node": ranks, "ckpt_copies_node": ranks,
    }  # fmt: skip


def table(rows: list[tuple[Figures, dict[str, float]]]) -> str:
    head = (f"{'nodes':>6} {'ranks':>6} | {'FS ops/s':>9} {'a node':>7} | {'store req':>13} | "
            f"{'start-up s':>10} | {'SLURM/min':>9} | {'ckpt files':>10} {'a node':>6} | "
            f"{'copies a node':>13}")  # fmt: skip
    lines = [head, "-" * len(head)]
    for f, old in rows:
        copies = f"{f.ckpt_copies_first_node} (first), {f.ckpt_copies_node}"
        lines.append(
            f"{f.nodes:>6} {f.ranks:>6} | {f.fs_ops_per_s:>9.2f} {f.fs_ops_per_s_per_node:>7.3f} | "
            f"{f.store_requests:>13,} | {f.startup_s:>10.1f} | {f.slurm_calls_per_min:>9.1f} | "
            f"{f.ckpt_files:>10,} {f.ckpt_files_node:>6} | {copies:>13}"
        )
        lines.append(
            f"{'before':>13} | {old['fs_ops_per_s']:>9.0f} {old['fs_ops_per_s_per_node']:>7.2f} | "
            f"{old['store_requests']:>13,} | {old['startup_s']:>10.0f} | "
            f"{old['slurm_calls_per_min']:>9.1f} | {old['ckpt_files']:>10,} "
            f"{old['ckpt_files_node']:>6} | {old['ckpt_copies_node']:>13}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, nargs="*", default=[8, 64, 512, 2048])
    ap.add_argument("--ranks", type=int, default=8, help="ranks a node")
    ap.add_argument("--seconds", type=float, default=10.0, help="steady training, simulated")
    ap.add_argument("--store-ranks", type=int, default=512,
                    help="the largest world whose exchange runs over the TCPStore")  # fmt: skip
    ap.add_argument("--round-s", type=float, default=0.05,
                    help="a world checks' round (assumed: a pair's tests, its group)")  # fmt: skip
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if any(n < 1 for n in args.nodes) or args.ranks < 1:
        ap.error("--nodes and --ranks must be at least 1")
    per_request_s = request_seconds()
    print(f"ddppipe's control plane, a scale model, {time.strftime('%Y-%m-%d %H:%M')}, "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}: a store request "
          f"{per_request_s * 1e6:.0f} us (measured here), a world checks' round "
          f"{args.round_s} s (assumed)")  # fmt: skip
    rows, per_rank = [], {}
    for nodes in args.nodes:
        found = model(nodes, args.ranks, args.seconds, args.store_ranks, per_request_s,
                      args.round_s, per_rank)  # fmt: skip
        rows.append((found, before(nodes, args.ranks, per_request_s, args.round_s)))
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(
            {"per_request_s": per_request_s, "round_s": args.round_s,
             "rows": [{**asdict(f), "before": old} for f, old in rows]}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
