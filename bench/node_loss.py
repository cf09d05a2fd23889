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

The run's goodput without a lost node, each before (no `train.checkpoint_minutes`:
checkpoints at epochs' ends and on the stop signal only) and after (every 0.25 min):

- `time_limit`: a clean run across a time limit: 2-minute slots, the warning 75 s before the
  limit (`slurm.signal_seconds`; the first slot trains about half the run on an idle
  machine): the slot checkpoints and its job requeues itself, the next slot ends the run;
- `crash`: rank 1 raises once, at a random training step of the first slot (seeded:
  `--seed`); the job fails and Snakemake's retry (the profile's `retries`) resumes the run
  from its newest checkpoint.

Printed for each: its slots, the summary's goodput line (share kept, largest loss), the steps
redone (the goodput account's) and the wall time of the `snakemake` call.

Needs root and the Slurm packages (`bash .ci/install_slurm.sh`), and no other test cluster
on the machine; about 3 minutes a run (`time_limit` and `crash`: two runs each).

    python bench/node_loss.py                     # every scenario
    python bench/node_loss.py --only spare        # one
    python bench/node_loss.py --only time_limit crash
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
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

from ddppipe.reports import goodput  # noqa: E402
from ddppipe.settings.presets import PRESETS  # noqa: E402
from ddppipe.training.measuring.heartbeat import Beat  # noqa: E402
from tests.slurm_cluster import (  # noqa: E402
    SlurmCluster,
    kill_pids,
    netns_pids,
)
from tests.slurm_fixtures import bench_cluster_refused  # noqa: E402

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
# Runs without a lost node, each before and after checkpoints by time: their slurm keys.
GOODPUT_SCENARIOS: dict[str, dict[str, Any]] = {
    "time_limit": {"runtime": 2, "signal_seconds": 75, "max_continuations": 30},
    "crash": {},
}
CHECKPOINT_MINUTES = 0.25
STEPS_PAST_CHECKPOINT = 5
MNIST_TRAIN = 60_000
# MNIST's model, rank 1 raising once at a training step (the retry trains on). The first slot's
# all-reduce probe (ddppipe.training.loop.probes) runs 2 x COMM_PROBES training forwards after
# its 10th step: a step past it is its forward minus those.
CRASH_TASK = '''\
"""MNIST, rank 1 raising once at training step {step} (bench/node_loss.py)."""

import os
from pathlib import Path

import torch

from ddppipe.tasks import mnist
from ddppipe.tasks.mnist import ARGS_SCHEMA, datasets, prepare  # noqa: F401
from ddppipe.training.loop.probes import COMM_PROBES

CRASHED = Path({marker!r})
forwards = 0


def model(args: dict) -> torch.nn.Module:
    net = mnist.model(args)
    net.register_forward_pre_hook(crash)
    return net


def crash(module: torch.nn.Module, inputs: tuple) -> None:
    global forwards
    if os.environ.get("RANK") != "1" or not (module.training and torch.is_grad_enabled()):
        return
    forwards += 1
    if forwards == {step} + 2 * COMM_PROBES and not CRASHED.exists():
        CRASHED.touch()
        raise RuntimeError("crash at training step {step} (bench/node_loss.py)")
'''


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mirror", type=Path, default=SHARED_MNIST, help="folder of the *.gz files")
    ap.add_argument("--epochs", type=int, default=2)
    every = [*SCENARIOS, *GOODPUT_SCENARIOS]
    ap.add_argument("--only", choices=sorted(every), nargs="*", default=every)
    ap.add_argument("--seed", type=int, default=0, help="of the crash's step")
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
    cfg["slurm"].update({"mem_mb": 1500, "runtime": 10, "partition": "train", **slurm})
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


def start(cluster: SlurmCluster, work: Path, cfg: dict[str, Any]) -> subprocess.Popen[str]:
    """``snakemake --profile profiles/slurm`` training ``cfg`` in ``work`` (its output in
    ``work/snakemake.log``), started."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "config.yaml").write_text(yaml.safe_dump(cfg))
    bindir = str(Path(sys.executable).parent)
    with (work / "snakemake.log").open("w") as sink:
        return subprocess.Popen(
            [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(work),
             "--configfile", str(work / "config.yaml"), "--profile", str(PROFILE),
             f"results/{RUN}/train/final.pt"],
            cwd=work, stdout=sink, stderr=subprocess.STDOUT, text=True,
            env=cluster.environ({"PATH": f"{bindir}:/usr/bin:/bin:/usr/sbin"}),
        )  # fmt: skip


def goodput_line(log: str) -> str:
    """The summary's goodput line in a snakemake output."""
    found = re.findall(r"^\s*goodput\s+(.*)$", log, re.M)
    return found[-1] if found else "(no goodput line)"


def run_scenario(cluster: SlurmCluster, work: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    """One run in ``work``, its node killed mid-epoch; its figures."""
    state = work / "results" / RUN / "state"
    out = work / "snakemake.log"
    proc = start(cluster, work, cfg)
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
    return {
        "victim": victim,
        "history": history,
        "kill_to_step": after[0] - killed if after else None,
        "kill_to_outcome": history[0]["end"] - killed if history[0]["end"] else None,
        "redone": max(before) - history[1]["start_step"] if before else None,
        "jobs": jobs,
        "sacct": sacct,
        "goodput": goodput_line(log),
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


def crash_step(args: argparse.Namespace) -> int:
    """The crash's training step: seeded, uniform over the run's steps from the 20th (past
    the first slot's all-reduce probe) to the 20th before the last."""
    steps = args.epochs * -(-MNIST_TRAIN // PRESETS["fast"]["batch_size"])
    return random.Random(args.seed).randint(20, steps - 20)


def write_crash_task(work: Path, step: int) -> Path:
    """``work/tasks/crash.py``: :data:`CRASH_TASK` at ``step``, its mark in ``work``."""
    task = work / "tasks" / "crash.py"
    task.parent.mkdir(parents=True)
    task.write_text(CRASH_TASK.format(step=step, marker=str(work / "crashed")))
    return task


def run_to_end(cluster: SlurmCluster, work: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    """One run in ``work`` to its end, no node lost; its figures."""
    started = time.monotonic()
    proc = start(cluster, work, cfg)
    try:
        proc.wait(timeout=1500)
    finally:
        if proc.poll() is None:
            proc.kill()
    wall = time.monotonic() - started
    log = (work / "snakemake.log").read_text()
    if proc.returncode != 0:
        raise RuntimeError(f"snakemake failed:\n{log[-5000:]}")
    history = json.loads((work / f"results/{RUN}/train/attempts.json").read_text())
    account = goodput.account(history)
    return {
        "history": history,
        "wall": wall,
        "redone": account.total.redone_steps if account else None,
        "jobs": re.findall(r"submitted with SLURM jobid (\d+) \(log: [^)]*rule_train/", log),
        "goodput": goodput_line(log),
    }


def run_goodput(args: argparse.Namespace, cluster: SlurmCluster, root: Path, name: str) -> None:
    """Scenario ``name`` of :data:`GOODPUT_SCENARIOS`, before and after checkpoints by time;
    printed."""
    step = crash_step(args) if name == "crash" else None
    for variant in ("before", "after"):
        work = root / name / variant
        cfg = config_for(args, GOODPUT_SCENARIOS[name])
        if variant == "before":  # checkpoints at epochs' ends (and on the stop signal)
            del cfg["train"]["checkpoint_minutes"]
        if step is not None:
            cfg["task"] = str(write_crash_task(work, step))
            cfg["task_args"]["batchnorm"] = True  # the fast preset's ddppipe.tasks.mnist model
        try:
            f = run_to_end(cluster, work, cfg)
        except (RuntimeError, subprocess.SubprocessError, OSError) as e:
            print(f"  {name} {variant}: failed: {e}")
            continue
        crashed = f" (rank 1 crashes at step {step})" if step is not None else ""
        print(f"  {name} {variant}{crashed}: {len(f['history'])} slots, "
              f"train jobs {', '.join(f['jobs'])}, {f['wall']:.1f} s wall")  # fmt: skip
        for a in f["history"]:
            failed = a.get("failure") or {}
            print(f"    slot {a['number']}: job {a['job']}, {a['outcome']}, from step "
                  f"{a['start_step']} ({a.get('resumed_from') or 'the start'}) to "
                  f"{failed.get('step', a['end_step'])}")  # fmt: skip
        print(f"    steps redone {f['redone']}")
        print(f"    goodput: {f['goodput']}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if bench_cluster_refused():
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
                if name in GOODPUT_SCENARIOS:
                    run_goodput(args, cluster, root, name)
                    continue
                cfg = config_for(args, SCENARIOS[name])
                try:
                    report(name, run_scenario(cluster, root / name, cfg))
                except (RuntimeError, subprocess.SubprocessError, OSError) as e:
                    print(f"  {name}: failed: {e}")
    print(f"  load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
