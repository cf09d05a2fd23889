"""A node lost mid-epoch on the SLURM test cluster: recovered inside the job, and before.

For each scenario a throwaway three-node cluster with accounting (tests/slurm_cluster.py:
nodes bn[01-03], training in the non-default partition `train`) runs the default MNIST task
on 2 nodes x 1 process (`snakemake --profile profiles/slurm`, the train target), checkpoints
every `train.checkpoint_minutes` (0.25: 15 s). Once the run has committed a checkpoint and
trained 5 steps past it, the second node of the training step is killed as a node dies
(its slurmd and every process on it). Scenarios:

- `spare`: `slurm.spare_nodes: 1` (a 3-node job): the next step on the first node and the spare;
- `min_nodes`: `slurm.min_nodes: 1`, no spare (a 2-node job): the next step on the first node;
- `requeue` (before): neither: SLURM marks the node down (`SlurmdTimeout`, 60 s on the test
  cluster; 300 s is Slurm's default) and requeues the job.

Printed per scenario: the time from the kill to the next training step (rank 0's heartbeat
after the kill: phase `train` in a new process), from the kill to the slot's end as "node
failure", the steps redone (the last step begun before the kill minus the step the next slot
resumed at), the job ids of the train rule and sacct's records of them, and the summary's
goodput line.

Needs root and the Slurm packages (`bash .ci/install_slurm.sh`), and no other test cluster
on the machine; about 3 minutes a scenario.

    python bench/node_loss.py                     # every scenario
    python bench/node_loss.py --only spare        # one
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
import threading
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from overhead import SHARED_MNIST, sha256sums  # noqa: E402

from ddppipe.training.measuring.heartbeat import Beat  # noqa: E402
from tests.slurm_cluster import (  # noqa: E402
    CTLD_PORT,
    SlurmCluster,
    kill_pids,
    netns_pids,
    port_listening,
)
from tests.slurm_fixtures import slurm_unavailable_reason  # noqa: E402

NODES = ("bn01", "bn02", "bn03")
PARTITIONS = {
    "short": "Default=YES MaxTime=INFINITE State=UP",
    "train": "MaxTime=INFINITE State=UP",
}
PROFILE = REPO / "profiles" / "slurm"
RUN = "nodeloss"
SCENARIOS = {
    "spare": {"spare_nodes": 1},
    "min_nodes": {"min_nodes": 1},
    "requeue": {},
}
CHECKPOINT_MINUTES = 0.25
STEPS_PAST_CHECKPOINT = 5


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mirror", type=Path, default=SHARED_MNIST, help="folder of the *.gz files")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--only", choices=sorted(SCENARIOS), nargs="*", default=list(SCENARIOS))
    ap.add_argument("--keep", type=Path, help="run in this folder and keep it")
    return ap.parse_args(argv)


def config_for(args: argparse.Namespace, slurm: dict[str, Any]) -> dict[str, Any]:
    """The default config on MNIST, 2 nodes x 1 process of 1 core, checkpoints by time."""
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    cfg["run"] = RUN
    cfg["train"].update(epochs=args.epochs, checkpoint_minutes=CHECKPOINT_MINUTES)
    cfg["task_args"] = {"mirrors": [args.mirror.resolve().as_uri() + "/"],
                        "sha256": sha256sums(args.mirror)}  # fmt: skip
    cfg["launch"].update(nnodes=2, nproc_per_node=1, cpus_per_proc=1, max_restarts=0)
    cfg["slurm"].update(mem_mb=1500, runtime=10, partition="train", **slurm)
    return cfg


class BeatLog:
    """Rank 0's heartbeats, read every 0.1 s in a thread: (time, pid, phase, step)."""

    def __init__(self, path: Path) -> None:
        self.path, self.seen = path, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last = None
        while not self._stop.wait(0.1):
            beat = Beat.read(self.path)
            if beat is not None and (beat.pid, beat.phase, beat.step) != last:
                last = (beat.pid, beat.phase, beat.step)
                self.seen.append((time.time(), *last))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def committed(state: Path) -> list[Path]:
    return sorted((state / "checkpoints").glob("ckpt-*/COMMITTED"))


def run_scenario(cluster: SlurmCluster, work: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    """One run in ``work``, its node killed mid-epoch; its figures."""
    work.mkdir(parents=True)
    (work / "config.yaml").write_text(yaml.safe_dump(cfg))
    bindir = str(Path(sys.executable).parent)
    state = work / "results" / RUN / "state"
    out = work / "snakemake.log"
    with out.open("w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(work),
             "--configfile", str(work / "config.yaml"), "--profile", str(PROFILE),
             f"results/{RUN}/train/final.pt"],
            cwd=work, stdout=sink, stderr=subprocess.STDOUT, text=True,
            env=cluster.environ({"PATH": f"{bindir}:/usr/bin:/bin:/usr/sbin"}),
        )  # fmt: skip
    beats = BeatLog(state / "watchdog" / "rank-0.json")
    try:
        deadline = time.monotonic() + 600
        while not (committed(state) and beats.seen):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"no checkpoint before the kill:\n{out.read_text()[-5000:]}")
            time.sleep(0.1)
        saved = beats.seen[-1][3] or 0  # the step rank 0 reached as the checkpoint committed
        while (beats.seen[-1][3] or 0) < saved + STEPS_PAST_CHECKPOINT:
            time.sleep(0.05)
        history = json.loads((state / "attempts.json").read_text())
        victim, pid = history[-1]["nodes"][1], beats.seen[-1][1]
        killed = time.time()
        kill_pids(netns_pids(victim), grace=0)  # the node dies: slurmd, steps, ranks
        proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
        beats.stop()
    log = out.read_text()
    if proc.returncode != 0:
        raise RuntimeError(f"snakemake failed:\n{log[-5000:]}")
    history = json.loads((work / f"results/{RUN}/train/attempts.json").read_text())
    before = [s for t, p, _, s in beats.seen if p == pid and t <= killed and s is not None]
    after = [t for t, p, phase, _ in beats.seen if p != pid and t > killed and phase == "train"]
    jobs = re.findall(r"submitted with SLURM jobid (\d+) \(log: [^)]*rule_train/", log)
    sacct = cluster.run(["sacct", "-X", "-n", "-P", "-D", "-j", ",".join(jobs),
                         "-o", "JobID,State,NNodes,NodeList"]).stdout.split()  # fmt: skip
    goodput = re.findall(r"^\s*goodput\s+(.*)$", log, re.M)
    return {
        "victim": victim,
        "history": history,
        "kill_to_step": after[0] - killed if after else None,
        "kill_to_outcome": history[0]["end"] - killed if history[0]["end"] else None,
        "redone": max(before) - history[1]["start_step"] if before else None,
        "jobs": jobs,
        "sacct": sacct,
        "goodput": goodput[-1] if goodput else "(no goodput line)",
    }


def report(name: str, f: dict[str, Any]) -> None:
    print(f"  {name}: {f['victim']} killed")
    for a in f["history"]:
        print(f"    slot {a['number']}: job {a['job']} on {','.join(a['nodes'])}, "
              f"{a['outcome']}, steps {a['start_step']}..{a['end_step']}, "
              f"world size {a['world_size']}")  # fmt: skip
    for what, key in (("the next training step", "kill_to_step"),
                      ("the slot's end recorded", "kill_to_outcome")):  # fmt: skip
        value = f[key]
        print(f"    kill to {what:<30} " + (f"{value:6.1f} s" if value is not None else "-"))
    print(f"    steps redone                          {f['redone']}")
    print(f"    train jobs submitted: {', '.join(f['jobs'])}; sacct: {' '.join(f['sacct'])}")
    print(f"    goodput: {f['goodput']}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    reason = slurm_unavailable_reason()
    if reason is None and port_listening(CTLD_PORT):
        reason = f"a test cluster already runs on this machine (port {CTLD_PORT}): wait for it"
    if reason is not None:
        print(f"cannot run the SLURM test cluster: {reason}", file=sys.stderr)
        return 2
    print(f"ddppipe node loss, {time.strftime('%Y-%m-%d %H:%M')}, {platform.node()}, "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}; MNIST, {args.epochs} "
          f"epoch(s) on 2 nodes x 1 process, checkpoints every {CHECKPOINT_MINUTES} min; "
          f"the test cluster's SlurmdTimeout 60 s")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="ddppipe-node-loss-") as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        for name in args.only:
            cluster = SlurmCluster(root / f"cluster-{name}", accounting=True, nodes=NODES,
                                   partitions=PARTITIONS, gpus_per_node=0)  # fmt: skip
            with cluster:
                cfg = config_for(args, SCENARIOS[name])
                try:
                    report(name, run_scenario(cluster, root / name, cfg))
                except (RuntimeError, subprocess.SubprocessError, OSError) as e:
                    print(f"  {name}: failed: {e}")
    print(f"  load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
