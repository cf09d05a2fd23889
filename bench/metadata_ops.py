"""The shared filesystem's metadata operations a training costs, per node, on the SLURM test
cluster: opens, creates, deletes and renames under the run's ``results/`` in steady training.

Starts a throwaway test cluster (tests/slurm_cluster.py, 3 CPUs a node), runs the default DAG
(`--profile profiles/slurm`) on the tests' tiny data (made larger: one long epoch) for each
layout asked (nodes x ranks a node), counts every metadata operation under ``results/`` with
inotify (bench/fs_ops.py: the test cluster's nodes share this host's filesystem, so it sees
them all) and prints, per layout, the operations a second and a second per node in steady
training: from 3 s after the ranks' first step (the slot's record, attempts.json) to 10 s before
the slot's end (its last evaluation, checkpoint and exit), and the files they touched most.

``--repo`` runs another checkout's DAG (its Snakefile, its ``.venv``): the same count for the
code before a change. Needs root and the Slurm packages, and no other test cluster running
(take /tmp/slurm-cluster.lock); about 2 minutes a layout.

    python bench/metadata_ops.py                        # 1x2 and 2x3
    python bench/metadata_ops.py --layouts 2x2 --json out.json
    python bench/metadata_ops.py --repo /path/to/older/checkout
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from fs_ops import METADATA, Watcher  # noqa: E402

from tests.slurm_cluster import SlurmCluster  # noqa: E402
from tests.slurm_fixtures import bench_cluster_refused  # noqa: E402
from tests.tiny import make_tiny, tiny_config  # noqa: E402

RUN = "metaops"
NODES = ("node1", "node2")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", nargs="*", default=["1x2", "2x3"], help="NODESxRANKS")
    ap.add_argument("--images", type=int, default=24000, help="training images (one epoch)")
    ap.add_argument("--repo", type=Path, default=REPO, help="the checkout whose DAG runs")
    ap.add_argument("--keep", type=Path, help="run in this folder and keep it")
    ap.add_argument("--json", type=Path, help="write the figures here too")
    return ap.parse_args(argv)


def layout(text: str) -> tuple[int, int]:
    nodes, _, ranks = text.partition("x")
    if not (nodes.isdigit() and ranks.isdigit()) or int(nodes) not in (1, 2):
        raise SystemExit(f"--layouts: {text!r} is not NODESxRANKS with 1 or 2 nodes")
    return int(nodes), int(ranks)


def config_for(data: Any, nodes: int, ranks: int) -> dict[str, Any]:
    """The tests' tiny config, one epoch, ``nodes`` x ``ranks`` processes of 1 core."""
    cfg = tiny_config(data, epochs=1, batch_size=8 * nodes * ranks, eval_batch_size=256)
    cfg["run"] = RUN
    cfg["launch"].update(nnodes=nodes, nproc_per_node=ranks, cpus_per_proc=1, max_restarts=0)
    cfg["slurm"].update(mem_mb=1500 * ranks, runtime=15)
    return cfg


def run_dag(cluster: SlurmCluster, repo: Path, work: Path, cfg: dict[str, Any]) -> tuple:
    """One DAG in ``work`` under an inotify watch of its results/; the watch's events (their
    times Unix times) and the slot's record."""
    work.mkdir(parents=True)
    (work / "config.yaml").write_text(yaml.safe_dump(cfg))
    python = repo / ".venv" / "bin" / "python"
    offset = time.time() - time.monotonic()
    with Watcher(work / "results") as watcher:
        result = subprocess.run(
            [str(python), "-m", "snakemake", "-s", str(repo / "Snakefile"), "-d", str(work),
             "--configfile", str(work / "config.yaml"), "--profile", str(repo / "profiles/slurm")],
            cwd=work, capture_output=True, text=True, check=False,
            env=cluster.environ({"PATH": f"{python.parent}:/usr/bin:/bin:/usr/sbin"}),
        )  # fmt: skip
    (work / "snakemake.log").write_text(result.stderr)
    if result.returncode != 0:
        raise RuntimeError(f"snakemake failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    (attempt,) = json.loads((work / f"results/{RUN}/train/attempts.json").read_text())
    events = [(e.at + offset, e.kind, e.path) for e in watcher.events]
    return events, attempt


def steady(attempt: dict[str, Any]) -> tuple[float, float]:
    """Steady training: 3 s after the ranks' first step to 10 s before the slot's end."""
    first = (attempt.get("marks") or {}).get("rank_first_step")
    if first is None or attempt["end"] - 10.0 - (first + 3.0) < 10.0:
        raise RuntimeError(f"no steady training of 10 s in {attempt}: give it more --images")
    return first + 3.0, attempt["end"] - 10.0


def figures(events: list, attempt: dict[str, Any], nodes: int, ranks: int) -> dict[str, Any]:
    start, end = steady(attempt)
    counted = [(kind, path) for at, kind, path in events if start <= at < end and kind in METADATA]
    seconds = end - start
    kinds = Counter(kind for kind, _ in counted)
    paths = Counter(f"{kind} {path.split('/', 1)[-1]}" for kind, path in counted)
    total = len(counted)
    return {
        "layout": f"{nodes}x{ranks}", "seconds": round(seconds, 1), "operations": total,
        "per_s": round(total / seconds, 2), "per_s_per_node": round(total / seconds / nodes, 2),
        "kinds": dict(kinds), "top": paths.most_common(8),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    layouts = [layout(text) for text in args.layouts]
    if bench_cluster_refused():
        return 2
    found = []
    with tempfile.TemporaryDirectory(prefix="ddppipe-metaops-") as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        data = make_tiny(root / "tiny", n_train=args.images)
        most = max(ranks for _, ranks in layouts)
        cluster = SlurmCluster(root / "cluster", nodes=NODES, cpus_per_node=most)
        with cluster:
            print(f"metadata operations under results/, {time.strftime('%Y-%m-%d %H:%M')}, "
                  f"{platform.node()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}, "
                  f"the DAG of {args.repo}")  # fmt: skip
            for nodes, ranks in layouts:
                work = root / f"dag-{nodes}x{ranks}"
                events, attempt = run_dag(cluster, args.repo, work, config_for(data, nodes, ranks))
                f = figures(events, attempt, nodes, ranks)
                found.append(f)
                print(
                    f"  {f['layout']}: {f['operations']} in {f['seconds']} s of steady "
                    f"training: {f['per_s']}/s, {f['per_s_per_node']}/s a node {f['kinds']}"
                )
                for text, count in f["top"]:
                    print(f"      {count:5d}  {text}")
    if args.json:
        args.json.write_text(json.dumps(found, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
