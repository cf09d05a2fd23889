"""What the SLURM DAG costs outside training: a 1-epoch, 2-node run on a real test cluster.

Starts a throwaway two-node cluster (tests/slurm_cluster.py: nodes sn03, sn04, training in
the non-default partition `batch`) with Slurm's DEFAULT scheduler settings (no
SchedulerParameters: sched_interval 60 s, bf_interval 30 s, batch_sched_delay 3 s), runs the
default DAG with `--profile profiles/slurm` on MNIST served from a local mirror, once per
value of the plugin's `slurm-init-seconds-before-status-checks` asked for, and prints:

- the DAG's wall time, the training attempt's wall time (the launcher's slot, attempts.json),
  its queue wait, and the difference: the overhead;
- the train job as SLURM saw it (submit, start, end: scontrol) and as Snakemake saw it (its
  log's time stamps), so how late the plugin's polling noticed the job's end;
- the slot's start-up in parts: from the job's start to its first step done
  (ddppipe.runstate.startup: job to launcher, launcher, agents, ranks, the ranks' checks of
  their nodes and the world, data, model, checkpoint load, first step).

``--tiny`` trains the tests' tiny config (256 synthetic images) instead of MNIST: a slot of
almost nothing but its start-up.

Needs root and the Slurm packages (`bash .ci/install_slurm.sh`), and no other test cluster
running on the machine; takes about 2 minutes a value.

    python bench/slurm_overhead.py                          # as root; the profile's setting
    python bench/slurm_overhead.py --init-seconds 2 10 40   # compare values
    python bench/slurm_overhead.py --tiny --runs 3          # the start-up, three times
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

from ddppipe.runstate import startup  # noqa: E402
from tests.slurm_cluster import SlurmCluster  # noqa: E402
from tests.slurm_fixtures import bench_cluster_refused  # noqa: E402
from tests.tiny import make_tiny, tiny_config  # noqa: E402
from tests.workflow_helpers import stamps  # noqa: E402

NODES = ("sn03", "sn04")
PARTITIONS = {
    "short": "Default=YES MaxTime=INFINITE State=UP",
    "batch": "MaxTime=INFINITE State=UP",
}
TRAIN_PARTITION = "batch"
PROFILE = REPO / "profiles" / "slurm"
RUN = "slurmoverhead"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mirror", type=Path, default=SHARED_MNIST, help="folder of the *.gz files")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--init-seconds", type=int, nargs="*", default=[],
                    help="values of slurm-init-seconds-before-status-checks to try "
                         "(default: the profile's)")  # fmt: skip
    ap.add_argument("--keep", type=Path, help="run in this folder and keep it")
    ap.add_argument("--tiny", action="store_true", help="the tests' tiny config, not MNIST")
    ap.add_argument("--runs", type=int, default=1, help="DAGs per value (each its own run)")
    return ap.parse_args(argv)


def profile_init_seconds() -> int:
    profile = yaml.safe_load((PROFILE / "config.yaml").read_text())
    return int(profile["slurm-init-seconds-before-status-checks"])


def config_for(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """The default config on MNIST (``--tiny``: the tests' tiny data made in ``root``), 2 nodes
    x 2 processes of 1 core (the test cluster's)."""
    if args.tiny:
        cfg = tiny_config(make_tiny(root / "tiny"))
    else:
        cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
        cfg["task_args"] = {"mirrors": [args.mirror.resolve().as_uri() + "/"],
                            "sha256": sha256sums(args.mirror)}  # fmt: skip
    cfg["run"] = RUN
    cfg["train"].update(epochs=args.epochs)
    cfg["launch"].update(nnodes=2, nproc_per_node=2, cpus_per_proc=1, max_restarts=0)
    cfg["slurm"].update(mem_mb=1500, runtime=10, partition=TRAIN_PARTITION)
    return cfg


def slurm_times(cluster: SlurmCluster, job: str) -> dict[str, float]:
    """SubmitTime, StartTime, EndTime of the job (slurmctld keeps it for MinJobAge)."""
    from ddppipe.slurm import scontrol

    record = scontrol.parse_record(cluster.run(["scontrol", "-o", "show", "job", job]).stdout)
    return {key: time.mktime(time.strptime(record[key], "%Y-%m-%dT%H:%M:%S"))
            for key in ("SubmitTime", "StartTime", "EndTime")}  # fmt: skip


def run_dag(cluster: SlurmCluster, work: Path, cfg: dict[str, Any], init: int) -> dict[str, Any]:
    """One DAG in ``work``; its figures."""
    work.mkdir(parents=True)
    (work / "config.yaml").write_text(yaml.safe_dump(cfg))
    bindir = str(Path(sys.executable).parent)
    began, started = time.time(), time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(work),
         "--configfile", str(work / "config.yaml"), "--profile", str(PROFILE),
         "--slurm-init-seconds-before-status-checks", str(init)],
        cwd=work, capture_output=True, text=True, check=False,
        env=cluster.environ({"PATH": f"{bindir}:/usr/bin:/bin:/usr/sbin"}),
    )  # fmt: skip
    wall = time.monotonic() - started
    (work / "snakemake.log").write_text(result.stderr)
    if result.returncode != 0:
        raise RuntimeError(f"snakemake failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    (attempt,) = json.loads((work / f"results/{RUN}/train/attempts.json").read_text())
    log = result.stderr
    (job,) = re.findall(r"submitted with SLURM jobid (\d+) \(log: [^)]*rule_train/", log)
    slurm = slurm_times(cluster, job)
    (seen_submit,) = stamps(log, r"^rule train:")
    (seen_end,) = stamps(log, r"Finished jobid: \d+ \(Rule: train\)")
    return {
        "wall": wall,
        "attempt": attempt["end"] - attempt["start"],
        "queue": attempt["queue_s"],
        "job_seen": seen_end - seen_submit,
        "job_slurm": slurm["EndTime"] - slurm["SubmitTime"],
        "noticed_after": seen_end - slurm["EndTime"],
        "before_submit": slurm["SubmitTime"] - began,
        "startup": startup.of_attempt(attempt) or {},
    }


def report(init: int, f: dict[str, Any]) -> None:
    print(f"  slurm-init-seconds-before-status-checks: {init}")
    print(f"    DAG wall                                   {f['wall']:6.1f} s")
    print(f"    training attempt (from the job's start)    {f['attempt']:6.1f} s")
    print(f"    its queue wait (scontrol)                  {f['queue']:6.1f} s")
    print(f"    DAG - attempt                              {f['wall'] - f['attempt']:6.1f} s")
    print(f"    snakemake start to the train job's submit  {f['before_submit']:6.0f} s")
    print(f"    train job, submit to end (SLURM)           {f['job_slurm']:6.0f} s")
    print(f"    train job as Snakemake saw it              {f['job_seen']:6.0f} s  "
          f"(its end noticed {f['noticed_after']:.0f} s late)")  # fmt: skip
    inside = f["job_slurm"] - f["queue"] - f["attempt"]
    after = f["wall"] - f["before_submit"] - f["job_seen"]
    print(f"    in the job, outside the attempt            {inside:6.0f} s  "
          "(the launcher's end, the job's)")  # fmt: skip
    print(f"    after the train job                        {after:6.0f} s  "
          "(local rules: evaluate, plots, export; the summary)")  # fmt: skip
    parts = f["startup"]
    if parts:
        print(f"    first step done after the job's start      {sum(parts.values()):6.1f} s:")
        for name, seconds in parts.items():
            print(f"      {name:<20} {seconds:6.2f} s")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if bench_cluster_refused():
        return 2
    inits = args.init_seconds or [profile_init_seconds()]
    with tempfile.TemporaryDirectory(prefix="ddppipe-slurm-overhead-") as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        cfg = config_for(args, root)
        cluster = SlurmCluster(root / "cluster", nodes=NODES, partitions=PARTITIONS,
                               settings={"SchedulerParameters": None})  # fmt: skip
        with cluster:
            conf = cluster.run(["scontrol", "show", "config"]).stdout
            sched = re.search(r"SchedulerParameters\s*=\s*(.*)", conf)
            sched_text = sched[1].strip() if sched else "?"
            print(f"ddppipe SLURM DAG overhead, {time.strftime('%Y-%m-%d %H:%M')}, "
                  f"{platform.node()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}; "
                  f"{args.epochs} epoch(s) of {'tiny data' if args.tiny else 'MNIST'} on "
                  f"{len(NODES)} nodes x 2 processes; "
                  f"SchedulerParameters {sched_text} (Slurm's defaults)")  # fmt: skip
            for i, init in enumerate(inits):
                for run in range(args.runs):
                    work = root / f"dag-{i}-init{init}-{run}"
                    report(init, run_dag(cluster, work, cfg, init))
            print(f"  load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
