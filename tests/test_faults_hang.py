"""A rank that hangs in the user's own code: the progress watchdog (launch.hang_timeout_s)
ends the slot in seconds, names the rank and the user's frame, and records every rank's stack;
on SLURM the job continues from the last checkpoint in a new slot."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from ddppipe.launching import lifecycle, slot_machine, watchdog
from ddppipe.runstate.attempts import Attempt
from ddppipe.runstate.state import StateDir
from ddppipe.settings import run_spec
from ddppipe.training.measuring import allowances, heartbeat, node_summary
from tests.tiny import default_config
from tests.workflow_helpers import snakemake

# A task file as a user writes it, whose model gets stuck once on rank 1: its 31st forward in
# training mode (the 25th step: the all-reduce probe at step 10 runs 6 more forwards), in the
# run's first slot only, as a deadlock in user code would.
STUCK_TASK = '''\
"""Two noisy blobs and a small MLP; rank 1's forward gets stuck once, in the first slot."""

import json
import logging
import os
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

STUCK_AT = 31  # forward calls in training mode


def prepare(data_dir: Path, args: dict) -> None:
    data_dir.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1200, 8, generator=g)
    y = (x[:, 0] + x[:, 1] > 0).long()
    torch.save({"x": x, "y": y}, data_dir / "blobs.pt")


def datasets(data_dir: Path, args: dict) -> tuple[TensorDataset, TensorDataset]:
    blobs = torch.load(data_dir / "blobs.pt")
    x, y = blobs["x"], blobs["y"]
    return TensorDataset(x[:1000], y[:1000]), TensorDataset(x[1000:], y[1000:])


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            first_slot = json.loads(Path(os.environ["DDPPIPE_SLOT"]).read_text())["attempt"] == 1
            if self.calls == STUCK_AT and os.environ.get("RANK") == "1" and first_slot:
                logging.getLogger("stuck").warning("rank 1 gets stuck")
                time.sleep(3600)
        return self.layers(x)


def model(args: dict) -> nn.Module:
    return Net()
'''
SLEEP_LINE = 1 + STUCK_TASK.splitlines().index("                time.sleep(3600)")
TIMEOUT_S = 3


def stuck_config(run: str) -> dict:
    """tasks/stuck.py: 3 epochs of 20 steps (1,000 samples, batches of 50), a checkpoint
    every epoch, the watchdog at 3 s."""
    cfg = default_config()
    cfg.update(run=run, task="tasks/stuck.py", task_args={})
    cfg["train"].update(epochs=3, batch_size=50, eval_batch_size=200, checkpoint_every=1)
    cfg["launch"]["hang_timeout_s"] = TIMEOUT_S
    return cfg


def with_stuck_task(workdir: Path) -> Path:
    (workdir / "tasks").mkdir(parents=True, exist_ok=True)
    (workdir / "tasks" / "stuck.py").write_text(STUCK_TASK)
    return workdir / "tasks" / "stuck.py"


def stuck_at(log: str) -> float:
    """Unix time of the task's "rank 1 gets stuck" log line (ddppipe's log format)."""
    stamp = re.search(r"^(\S+ \S+) \[rank 1\] WARNING stuck: rank 1 gets stuck", log, re.M)
    assert stamp, log[-3000:]
    return datetime.strptime(stamp[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()


# -- the allowance, and the stacks -------------------------------------------------------------


@pytest.mark.parametrize(
    ("setting", "phase", "slowest", "longest", "expected", "why"),
    [
        ("auto", "train", None, None, 600.0, "a step's: the bound of a slot's first steps"),
        ("auto", "train", 0.05, None, 120.0, "a step's: 10 x the slowest step of the slot, 0.05 s"),
        ("auto", "train", 30.0, None, 300.0, "a step's: 10 x the slowest step"),
        ("auto", "evaluate", 0.05, None, 600.0, "evaluate's fixed bound (its first in the slot)"),
        ("auto", "data", 0.05, None, 900.0, "data's fixed bound"),
        ("auto", "checkpoint", 90.0, None, 900.0, "checkpoint's: a step's"),  # never less
        (3, "train", None, None, 3.0, "a step's: launch.hang_timeout_s"),  # from the start
        (3, "start-up", None, None, 600.0, "start-up's fixed bound"),
        (2000, "evaluate", 0.05, None, 2000.0, "evaluate's: a step's, launch.hang_timeout_s"),
        # after the first in the slot: what it measured, within a step's and the fixed bound
        ("auto", "epoch-start", 0.05, None, 600.0, "epoch-start's fixed bound (its first"),
        ("auto", "epoch-start", 0.05, 0.4, 120.0, "epoch-start's after its first in the slot"),
        ("auto", "evaluate", 0.05, 20.0, 200.0, "evaluate's after its first in the slot: 10 x"),
        ("auto", "evaluate", 0.05, 90.0, 600.0, "evaluate's fixed bound"),  # never looser
        (3, "evaluate", None, 0.5, 5.0, "evaluate's after its first in the slot: 10 x"),
        ("auto", "checkpoint", 0.05, 1.0, 600.0, "checkpoint's fixed bound"),  # not recurring
        ("auto", "data", 0.05, 1.0, 900.0, "data's fixed bound"),  # once a slot
    ],
)
def test_allowance(
    setting: float | str, phase: str, slowest: float | None, longest: float | None,
    expected: float, why: str,
) -> None:  # fmt: skip
    allowed = allowances.allowance(setting, phase, slowest, longest)
    assert allowed.seconds == expected
    assert allowed.why.startswith(why), allowed.why


def test_the_watchdog_allows_an_evaluation_what_the_first_took(tmp_path: Path) -> None:
    """A rank's heartbeat measures its first evaluation (0.5 s); hang_timeout_s 3: the second
    one is allowed 10 times that. Its node's summary judges it (its own clock: late after
    5 s, reported at once, not 5 s later) and the launcher's watchdog names that allowance."""
    cfg = default_config()
    cfg["launch"]["hang_timeout_s"] = TIMEOUT_S
    spec = run_spec.resolve(cfg, False)
    state = StateDir(tmp_path / "state")
    dog = watchdog.Watchdog(spec, state, 1, None)
    dog.environment()
    local = tmp_path / "node-local"
    local.mkdir()
    heart = heartbeat.Heart(local, 0, True, False)
    heart.beat("evaluate")
    time.sleep(0.5)
    heart.beat("checkpoint")
    heart.beat("evaluate")  # the second evaluation
    heart._write()
    summary = node_summary.Summary("", "cn1", local, state, TIMEOUT_S, now=0.0)
    t0 = time.monotonic()
    summary.step(0.0)
    assert summary.writes == 1 and dog._check(t0) is None
    summary.step(4.0)
    assert summary.writes == 1 and not summary.late(0, 4.0)  # (the first: 600 s)
    summary.step(6.0)
    assert summary.writes == 2  # news: rank 0 is late
    late, allowed = dog._check(t0 + 6.0) or ([], None)
    assert [v.rank for v in late] == [0] and allowed is not None
    assert 5.0 <= allowed.seconds < 5.5, allowed
    assert allowed.why.startswith("evaluate's after its first in the slot: 10 x its longest")


def test_a_gpu_ranks_flight_recorder_is_dumped_after_its_stack(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The launcher's request for the NCCL flight recorder is the rank's own stack dump (no
    file polled on the shared filesystem): once its stack file has bytes, the heartbeat's
    thread dumps the recorder, once (the recorder itself mocked: no GPU here)."""
    dumped: list[int] = []
    monkeypatch.setattr(heartbeat.Heart, "_dump_nccl_trace", lambda self: dumped.append(self.rank))
    fd = os.open(tmp_path / "rank-0.stacks", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        heartbeat.Heart(tmp_path, 0, True, True, tmp_path / "shared", fd)
        time.sleep(heartbeat.WRITE_EVERY_S * 1.2)  # (a round of its thread)
        assert dumped == []
        os.write(fd, b"Thread 0x1 (most recent call first):\n")
        deadline = time.monotonic() + 5
        while not dumped and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(heartbeat.WRITE_EVERY_S * 1.2)  # (a round of its thread)
        assert dumped == [0]
    finally:
        os.close(fd)


def test_a_rank_whose_nodes_record_stopped_is_late_after_its_allowance_and_two_reports(
    tmp_path: Path,
) -> None:
    """A node's agent gone (its record no longer changes): its rank, judged fine in the last
    record, is named by the launcher's own clock after its allowance (3 s) and two missed
    reports (10 s), not before."""
    cfg = default_config()
    cfg["launch"]["hang_timeout_s"] = TIMEOUT_S
    state = StateDir(tmp_path / "state")
    dog = watchdog.Watchdog(run_spec.resolve(cfg, False), state, 1, None, world_size=1)
    dog.environment()
    local = tmp_path / "node-local"
    local.mkdir()
    heart = heartbeat.Heart(local, 0, True, False, background=False)
    heart.beat("train", 1)
    heart._write()
    node_summary.Summary("", "cn1", local, state, TIMEOUT_S).step(0.0)
    t0 = time.monotonic()
    assert dog._check(t0) is None
    assert dog._check(t0 + 12.5) is None
    late, allowed = dog._check(t0 + 13.5) or ([], None)
    assert [v.rank for v in late] == [0] and allowed is not None and allowed.seconds == 3.0


def test_a_lost_nodes_step_is_the_one_the_ranks_heartbeats_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step the node watch kills when a node is lost: the ranks' heartbeats (in their
    node's record) name it, no squeue asked (job 77 is none of SLURM's: squeue would name no
    step); a rank that never beat is left out."""
    spec = run_spec.resolve(default_config(), False)
    state = StateDir(tmp_path / "state")
    dog = watchdog.Watchdog(spec, state, 1, "77")
    dog.environment()
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_STEP_ID", "3")
    local = tmp_path / "node-local"
    local.mkdir()
    heart = heartbeat.Heart(local, 0, True, False)
    heart.beat("train", 5)
    heart._write()
    node_summary.Summary("", "cn1", local, state, "auto").step(0.0)
    assert [(b.rank, b.slurm_step) for b in dog.beats()] == [(0, "77.3")]
    assert watchdog.steps("77", dog.beats()) == ["77.3"]
    assert watchdog.steps("77", []) == []


@pytest.mark.parametrize(("nodes", "bound"), [(1, 600.0), (64, 632.0)])
def test_a_nodes_summary_allows_start_up_what_the_runs_nodes_give(
    tmp_path: Path, nodes: int, bound: float
) -> None:
    """A node's agent judges a rank still starting by start-up's allowance at the run's size
    (``launch.nnodes``, passed on by the launcher): 600 s at 1 node, 632 s at 64."""
    local = tmp_path / "node-local"
    local.mkdir()
    heartbeat.Heart(local, 0, True, False, background=False)
    summary = node_summary.Summary("L", "cn1", local, StateDir(tmp_path / "state"), "auto",
                                   now=0.0, nodes=nodes)  # fmt: skip
    summary.poll(0.0)
    assert not summary.late(0, bound - 1.0)
    assert summary.late(0, bound + 1.0)


def test_a_ranks_stack_dump_reaches_the_state_folder_once_whole(tmp_path: Path) -> None:
    """A rank dumps its stack node-locally (faulthandler's file); its node's summary copies it
    to the state folder once it stopped growing, and not again."""
    state, local = StateDir(tmp_path / "state"), tmp_path / "node-local"
    local.mkdir()
    heart = heartbeat.Heart(local, 2, True, False, background=False)
    heart._write()
    summary = node_summary.Summary("L", "cn1", local, state, "auto", now=0.0)
    dump, copied = heartbeat.stacks_file(local, 2), heartbeat.stacks_file(state.watchdog, 2)
    summary.poll(0.0)
    dump.write_text('Thread 0x1 (most recent call first):\n  File "a.py", line 3 in f\n')
    summary.poll(0.5)  # (still growing, for all it knows)
    assert not copied.exists()
    summary.poll(1.0)
    assert copied.read_text() == dump.read_text()
    copied.unlink()
    summary.poll(1.5)
    assert not copied.exists()  # written once


@pytest.mark.parametrize(
    ("setting", "expected"),
    [("auto", 7200.0), (3, 1200.0), (600, 1200.0), (2000, 2300.0)],
)
def test_the_process_groups_timeout_is_above_every_allowance(
    setting: float | str, expected: float
) -> None:
    """NCCL's watchdog aborts a collective at the process group's timeout, recording nothing:
    the hang watchdog's longest allowance (data's 900 s, or hang_timeout_s above it) plus the
    300 s it takes to name a hang comes first (it was 600 s, whatever the setting)."""
    assert allowances.collective_timeout_s(setting) == expected


def test_a_stack_dump_names_the_main_threads_frames(tmp_path: Path) -> None:
    """A real faulthandler dump of a process blocked in time.sleep in a helper thread's
    presence: the main thread's frames, innermost first, the user's frame found."""
    user = tmp_path / "user.py"
    user.write_text(
        "import faulthandler, signal, sys, threading, time\n"
        f"faulthandler.register(signal.{heartbeat.DUMP_SIGNAL.name}, file=open(sys.argv[1], 'w'),"
        " all_threads=True)\n"
        "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
        "print(threading.main_thread().ident, flush=True)\n"
        "def stuck():\n"
        "    time.sleep(60)\n"
        "stuck()\n"
    )
    dump = tmp_path / "dump.txt"
    proc = subprocess.Popen([sys.executable, str(user), str(dump)], stdout=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        main = int(proc.stdout.readline())
        time.sleep(0.2)
        proc.send_signal(heartbeat.DUMP_SIGNAL)
        deadline = time.monotonic() + 10
        while "stuck" not in dump.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()
    threads = watchdog.parse_stacks(dump.read_text())
    assert len(threads) == 2
    frames = threads[main]
    assert [(f.function, f.line) for f in frames] == [("stuck", 6), ("<module>", 7)]
    assert watchdog.where(frames, str(user)) == watchdog.Frame(str(user), 6, "stuck")
    assert not watchdog.waiting(frames)


def slot(number: int, outcome: str, steps: int | None) -> Attempt:
    """Slot ``number`` of job 7 that ended with ``outcome`` after checkpointing ``steps``
    (None: before it resumed)."""
    start = None if steps is None else 100
    end = None if steps is None else 100 + steps
    return Attempt(number, "7", number - 1, ["cn07"], 0.0, outcome=outcome, start_step=start,
                   end_step=end)  # fmt: skip


@pytest.mark.parametrize(
    ("outcomes", "requeue"),
    [
        ([("hung", 20)], True),  # it checkpointed new steps: continue from them
        ([("hung", 0)], True),  # no new step: once more, the hang may have been transient
        ([("hung", None)], True),  # hung in start-up, before resuming
        ([("hung", 20), ("hung", 0)], True),
        ([("time limit", 0), ("hung", 0)], True),
        ([("hung", 0), ("hung", None)], False),  # twice in a row without progress: fail
        ([("hung", 0), ("hung", 0)], False),
    ],
)
def test_a_hung_slot_continues_unless_two_in_a_row_made_no_progress(
    outcomes: list[tuple[str, int | None]], requeue: bool
) -> None:
    history = [slot(n, outcome, steps) for n, (outcome, steps) in enumerate(outcomes, start=1)]
    decision = slot_machine.decide(history, max_continuations=100)
    assert decision.requeue == requeue
    if not requeue:
        n = len(history)
        assert decision.reason.startswith(
            f"slots {n - 1} and {n} hung without checkpointing a new step: not continuing"
        )


def test_gpu_ranks_keep_the_nccl_flight_recorder(tmp_path: Path) -> None:
    """The ranks' environment of a GPU run: the recorder's buffer, its dump on NCCL's timeout
    into the slot's watchdog folder, and its dump on a hang (the slot record's nccl_trace); a
    CPU run's gets none."""
    cfg = default_config()
    cfg["launch"]["device"] = "gpu"
    gpu_spec, cpu_spec = run_spec.resolve(cfg, gpus=True), run_spec.resolve(default_config(), False)
    gpu = watchdog.Watchdog(gpu_spec, StateDir(tmp_path / "state"), 1, None)
    folder = (tmp_path / "state" / "watchdog").resolve()
    assert gpu.environment() == {
        "DDPPIPE_HANG_TIMEOUT_S": "auto",
        "DDPPIPE_RUN_NODES": "1",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": f"{folder}/nccl-trace-rank-",
    }
    cpu = watchdog.Watchdog(cpu_spec, StateDir(tmp_path / "state"), 1, None)
    assert cpu.environment() == {"DDPPIPE_HANG_TIMEOUT_S": "auto", "DDPPIPE_RUN_NODES": "1"}
    assert folder.is_dir()
    opened = Attempt(1, "local", 0, ["here"], 0.0)
    state = StateDir(tmp_path / "state")
    assert lifecycle.slot_record(gpu_spec, state, opened, None, None).nccl_trace
    assert not lifecycle.slot_record(cpu_spec, state, opened, None, None).nccl_trace


# -- a local run -------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_hang_on_rank_1_ends_the_local_slot_naming_it(tmp_path: Path) -> None:
    """Rank 1 blocks in its forward; snakemake fails within the timeout and a few seconds,
    and its last lines name rank 1 and the line of the user's file it is stuck at."""
    task = with_stuck_task(tmp_path)
    started = time.monotonic()
    result = snakemake(tmp_path, stuck_config("stuck"), "--cores", "2", check=False)
    wall = time.monotonic() - started
    text = result.stdout + result.stderr
    assert result.returncode != 0, text
    train_log = (tmp_path / "logs/stuck/train.log").read_text()
    history = json.loads((tmp_path / "results/stuck/state/attempts.json").read_text())
    assert [a["outcome"] for a in history] == ["hung"], history
    fault_to_outcome = history[0]["end"] - stuck_at(train_log)
    frame = f"forward at tasks/stuck.py:{SLEEP_LINE}"
    assert history[0]["detail"].startswith(f"rank 1 ({history[0]['nodes'][0]}) in {frame}: ")
    assert fault_to_outcome < TIMEOUT_S + 6, (fault_to_outcome, train_log[-3000:])
    last = text.strip().splitlines()[-12:]
    assert any("hung" in line and frame in line for line in last), "\n".join(last)
    stacks = (tmp_path / "results/stuck/state/hangs/attempt-1.txt").read_text()
    assert f'File "{task.resolve()}", line {SLEEP_LINE}, in forward' in stacks, stacks
    assert "rank 0 (" in stacks and "torch/" in stacks.split("rank 1 (")[0], stacks
    print(
        f"(hang, local) fault to outcome {fault_to_outcome:.1f} s, snakemake {wall:.1f} s; "
        "its last lines:", *last, sep="\n  ",
    )  # fmt: skip


# (On SLURM: tests/test_faults_slurm.py, next to the crash run.)


# -- a script ----------------------------------------------------------------------------------

# A script as a user writes it: it logs a value every step; rank 1 stops answering at step 3
# in the run's first slot. Rank 0 goes on to the end and exits (an exited rank is not late).
STUCK_SCRIPT = """\
import os
import time

from ddppipe import job
from ddppipe.core import slot

for step in range(20):
    job.log(step, value=float(step))
    if step == 3 and os.environ["RANK"] == "1" and slot.read().attempt == 1:
        time.sleep(3600)
    time.sleep(0.05)
"""
SCRIPT_SLEEP_LINE = 1 + STUCK_SCRIPT.splitlines().index("        time.sleep(3600)")


def launch_script(run_dir: Path, script: str) -> tuple[subprocess.CompletedProcess, list]:
    """``ddppipe launch`` of ``script`` (its text, as run_dir/train.py) on 2 local ranks, the
    watchdog at 3 s; its result and attempt history."""
    from ddppipe.launching import resolve

    run_dir.mkdir(parents=True)
    (run_dir / "train.py").write_text(script)
    cfg = default_config()
    cfg.update(run="script", script=str(run_dir / "train.py"), task_args={})
    cfg["launch"]["hang_timeout_s"] = TIMEOUT_S
    cfg["tracking"]["tensorboard"] = False
    resolve.write_resolved(cfg, run_dir / "config.yaml")
    result = subprocess.run(
        [sys.executable, "-m", "ddppipe", "launch", "--config=config.yaml", "--state=state",
         "--outputs=outputs", "--metrics=metrics.jsonl"],
        cwd=run_dir, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return result, json.loads((run_dir / "state" / "attempts.json").read_text())


@pytest.mark.slow  # 6 s on 2 cores
def test_a_script_that_hangs_between_its_job_calls(tmp_path: Path) -> None:
    started = time.monotonic()
    result, history = launch_script(tmp_path / "run", STUCK_SCRIPT)
    assert result.returncode == 1, result.stderr
    assert [a["outcome"] for a in history] == ["hung"], result.stderr
    frame = f"<module> at train.py:{SCRIPT_SLEEP_LINE}"
    assert history[0]["detail"].startswith(f"rank 1 ({history[0]['nodes'][0]}) in {frame}: ")
    print(f"(hang, script) launch {time.monotonic() - started:.1f} s: {history[0]['detail']}")


def test_a_script_without_job_calls_is_said_to_be_unwatched(tmp_path: Path) -> None:
    result, history = launch_script(tmp_path / "run", "print('trained')\n")
    assert result.returncode == 0, result.stderr
    assert [(a["outcome"], a["detail"]) for a in history] == [
        ("completed", watchdog.NO_WATCHDOG_NOTE)
    ]
    assert watchdog.NO_WATCHDOG_NOTE in result.stderr
