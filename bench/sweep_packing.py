"""A sweep packed into held allocations against the same sweep as one SLURM job per trial.

Starts a throwaway two-node cluster (tests/slurm_cluster.py: nodes pk01, pk02 of 2 CPUs,
training in the non-default partition `batch`) with Slurm's DEFAULT scheduler settings (no
SchedulerParameters: sched_interval 60 s, bf_interval 30 s, as real sites keep them), and runs
a grid sweep of ``--trials`` one-epoch trials (train.seed 0..N-1: the same work each, one
process on one CPU) of MNIST served from a local mirror (``--task digits``: scikit-learn's
8x8 digits, a trial of about a second, where the submitting side's per-trial rules dominate)
twice with `--profile profiles/slurm`:

- packed: ``sweep.pack`` = 2 allocations of one node, 2 trials side by side on each;
- one job per trial: the same sweep without ``pack``, ``max_parallel`` 4 (the same 4 CPUs).

It prints, for each: the sweep's wall time, the sbatch calls (SLURM jobs of the sweep), the
CPU-hours held (packed: the allocations'; per trial: each training job's, submit-side
accounting of the trials' attempts), the scheduler's load (the calls of squeue, sacct,
scontrol and sbatch that the sweep made, anywhere: on the submitting machine and in its jobs;
per minute of the sweep) and, packed, how idle the slots were while trials remained.

Needs root and the Slurm packages, and no other test cluster on the machine; ~10 minutes.

    python bench/sweep_packing.py                 # 24 one-epoch MNIST trials
    python bench/sweep_packing.py --trials 8 --task digits
    python bench/sweep_packing.py --task digits --only packed
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from overhead import SHARED_MNIST, sha256sums  # noqa: E402

from tests.slurm_cluster import SlurmCluster  # noqa: E402
from tests.slurm_fixtures import bench_cluster_refused  # noqa: E402

NODES = ("pk01", "pk02")
PARTITIONS = {
    "short": "Default=YES MaxTime=INFINITE State=UP",
    "batch": "MaxTime=INFINITE State=UP",
}
PROFILE = REPO / "profiles" / "slurm"
COUNTED = ("squeue", "sacct", "scontrol", "sbatch")  # the calls that load slurmctld/slurmdbd


def counting_shims(folder: Path, log: Path) -> Path:
    """A folder of stand-ins for :data:`COUNTED` that log each call, then run the real one."""
    folder.mkdir(parents=True)
    for name in COUNTED:
        shim = folder / name
        shim.write_text(f'#!/bin/sh\necho "{name}" >> {log}\nexec /usr/bin/{name} "$@"\n')
        shim.chmod(0o755)
    return folder


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=24)
    ap.add_argument("--task", choices=["mnist", "digits"], default="mnist")
    ap.add_argument("--mirror", type=Path, default=SHARED_MNIST, help="folder of the *.gz files")
    ap.add_argument("--keep", type=Path, help="run in this folder and keep it")
    ap.add_argument("--only", choices=["packed", "jobs"], help="run the sweep one way only")
    return ap.parse_args(argv)


def config_for(args: argparse.Namespace, packed: bool) -> dict[str, Any]:
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    cfg["run"] = "base"
    if args.task == "digits":
        cfg.update(task="ddppipe.tasks.digits", task_args={"width": 8})
        cfg["train"].update(batch_size=64)
    else:
        cfg["task_args"] = {"mirrors": [args.mirror.resolve().as_uri() + "/"],
                            "sha256": sha256sums(args.mirror)}  # fmt: skip
    cfg["train"].update(epochs=1)
    cfg["launch"].update(nnodes=1, nproc_per_node=1, cpus_per_proc=1, max_restarts=0,
                         device="cpu")  # fmt: skip
    cfg["slurm"].update(mem_mb=1500, runtime=10, partition="batch")
    cfg["sweep"] = {"name": "packing", "parameters": {"train.seed": list(range(args.trials))},
                    "max_parallel": 4}  # fmt: skip
    if packed:
        cfg["sweep"]["pack"] = {"allocations": 2, "nodes": 1, "trials_per_node": 2,
                                "time_min": 30}  # fmt: skip
    return cfg


def job_seconds(cluster: SlurmCluster, job: str) -> float:
    """How long SLURM held job ``job``: its StartTime to its EndTime (slurmctld keeps a
    finished job for MinJobAge)."""
    from ddppipe.slurm import scontrol

    record = scontrol.parse_record(cluster.run(["scontrol", "-o", "show", "job", job]).stdout)
    start, end = (scontrol.timestamp(record[k]) for k in ("StartTime", "EndTime"))
    return (end or 0.0) - (start or 0.0)


def run_sweep(cluster: SlurmCluster, work: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    work.mkdir(parents=True)
    (work / "config.yaml").write_text(yaml.safe_dump(cfg))
    bindir = str(Path(sys.executable).parent)
    smk = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(work),
           "--configfile", str(work / "config.yaml"), "--profile", str(PROFILE)]  # fmt: skip
    calls = work / "scheduler-calls.log"
    shims = counting_shims(work / "shims", calls)
    env = cluster.environ({"PATH": f"{shims}:{bindir}:/usr/bin:/bin:/usr/sbin"})
    # the data and every trial's config first: the figures are the trainings'
    data = "digits" if cfg["task"] == "ddppipe.tasks.digits" else "mnist"
    subprocess.run([*smk, f"resources/{data}/manifest.json"], cwd=work, env=env, check=True,
                   capture_output=True)  # fmt: skip
    calls.write_text("")
    started = time.monotonic()
    result = subprocess.run([*smk, "sweep"], cwd=work, capture_output=True, text=True,
                            check=False, env=env)  # fmt: skip
    wall = time.monotonic() - started
    made = calls.read_text().split()
    (work / "snakemake.log").write_text(result.stderr)
    if result.returncode != 0:
        raise RuntimeError(f"snakemake failed:\n{result.stderr[-5000:]}")
    trials = sorted((work / "results/sweeps/packing").glob("seed=*/train/attempts.json"))
    attempts = [a for t in trials for a in json.loads(t.read_text())]
    jobs = sorted({a["job"] for a in attempts}, key=int)
    out: dict[str, Any] = {"wall": wall, "trials": len(trials), "jobs": len(jobs),
                           "calls": {name: made.count(name) for name in COUNTED}}  # fmt: skip
    pool = work / "results/sweeps/packing/pack"
    deadline = time.monotonic() + 120  # the call's end closed the pool: its nodes end
    while (
        pool.is_dir()
        and time.monotonic() < deadline
        and not all(
            "ended" in json.loads(p.read_text())
            for p in (pool / "allocations/nodes").glob("*.json")
        )
    ):
        time.sleep(0.5)
    if pool.is_dir():
        from ddppipe.packing import allocation_cost

        cost = allocation_cost.cost(pool)
        assert cost is not None
        out.update(jobs=len(cost.jobs), cpu_hours=cost.held_hours,
                   idle=cost.idle_while_trials, queue=max(cost.queue_s))  # fmt: skip
    else:  # each trial's job held its one CPU from its start to its end (scontrol)
        submitted = re.findall(r"submitted with SLURM jobid (\d+)", result.stderr)
        held = [job_seconds(cluster, job) for job in submitted]
        out["cpu_hours"] = sum(held) / 3600
        out["queue"] = max(a["queue_s"] or 0.0 for a in attempts)
        out["jobs"] = len(submitted)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if bench_cluster_refused():
        return 2
    with tempfile.TemporaryDirectory(prefix="ddppipe-sweep-packing-") as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        cluster = SlurmCluster(root / "cluster", nodes=NODES, partitions=PARTITIONS,
                               settings={"SchedulerParameters": None})  # fmt: skip
        with cluster:
            print(f"ddppipe packed sweep, {time.strftime('%Y-%m-%d %H:%M')}, {platform.node()}, "
                  f"{os.cpu_count()} CPUs; {args.trials} one-epoch {args.task} trials, 2 nodes x 2 "
                  "CPUs, Slurm's default scheduler settings")  # fmt: skip
            for name, packed in (("packed (2 allocations x 2 slots)", True),
                                 ("one job per trial (max_parallel 4)", False)):  # fmt: skip
                if args.only and args.only != ("packed" if packed else "jobs"):
                    continue
                f = run_sweep(cluster, root / ("packed" if packed else "jobs"),
                              config_for(args, packed))  # fmt: skip
                print(f"  {name}")
                print(f"    trials completed          {f['trials']:6d}")
                print(f"    sbatch calls (SLURM jobs) {f['jobs']:6d}")
                print(f"    sweep wall                {f['wall']:6.0f} s")
                print(f"    CPU-hours held            {f['cpu_hours']:8.4f}")
                print(f"    longest queue wait        {f['queue']:6.0f} s")
                per_min = {k: n / (f["wall"] / 60) for k, n in f["calls"].items()}
                print("    scheduler calls per minute " + ", ".join(
                    f"{k} {v:.1f}" for k, v in per_min.items()) + " (in all: " + ", ".join(
                    f"{k} {n}" for k, n in f["calls"].items()) + ")")  # fmt: skip
                if "idle" in f:
                    print(f"    slots idle while trials remained {f['idle']:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
