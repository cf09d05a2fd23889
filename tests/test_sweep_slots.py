"""A tpe round's wait for a free slot (ddppipe.sweeps.slots): which trials' trainings have
ended, read from their files and their state folders' locks, held by a real process."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ddppipe.runstate import attempts
from ddppipe.runstate.state import StateDir
from ddppipe.settings import layout
from ddppipe.settings import sweep as sweeps
from ddppipe.sweeps import slots
from tests.test_sweep_spec import parse

HOLDER = """
import sys, time
from pathlib import Path
from ddppipe.runstate import state_lock
from ddppipe.runstate.state import StateDir
with state_lock.hold(StateDir(Path(sys.argv[1])), None):
    print("held", flush=True)
    sys.stdin.read()
"""


def state_of(results: Path, run: str) -> StateDir:
    return StateDir(layout.RunLayout(run, results).state)


def slot(state: StateDir, outcome: str, exit_status: int | None) -> None:
    """A slot record of ``state``'s run that ended with ``outcome`` (end None: never closed)."""
    state.root.mkdir(parents=True, exist_ok=True)
    state.lock.touch()
    ended = None if exit_status is None else time.time()
    record = attempts.Attempt(1, "local", 0, ["n1"], time.time() - 5, ended, outcome, exit_status)
    attempts.save(state, [record])


@pytest.fixture
def holder(tmp_path: Path):
    """Start a process that holds a state folder's lock until the test lets it go."""
    started: list[subprocess.Popen] = []

    def hold(state: StateDir) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(state.root)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert proc.stdout.readline().strip() == "held"
        started.append(proc)
        return proc

    yield hold
    for proc in started:
        proc.communicate("")


def test_which_trainings_have_ended(tmp_path: Path, holder) -> None:
    results = tmp_path / "results"
    assert not slots.training_ended("sweeps/s/a", results)  # not started: holds its slot
    done = layout.RunLayout("sweeps/s/done", results).train.attempts
    done.parent.mkdir(parents=True)
    done.write_text("[]")
    assert slots.training_ended("sweeps/s/done", results)  # the train rule's output
    running = state_of(results, "sweeps/s/running")
    proc = holder(running)
    assert not slots.training_ended("sweeps/s/running", results)
    slot(running, "stopped on SIGUSR1", 75)  # while its launcher still holds the lock
    assert not slots.training_ended("sweeps/s/running", results)
    proc.communicate("")  # the launcher ends: the run waits for its next slot (exit 75)
    assert not slots.training_ended("sweeps/s/running", results)
    for outcome, status in [("crashed", 1), ("hung", 1), ("running", None)]:
        slot(state_of(results, f"sweeps/s/{outcome}"), outcome, status)
        assert slots.training_ended(f"sweeps/s/{outcome}", results), outcome  # failed, lost
    preflight = state_of(results, "sweeps/s/preflight")
    preflight.root.mkdir(parents=True)
    preflight.lock.touch()  # a launcher ran and ended before its first attempt
    assert slots.training_ended("sweeps/s/preflight", results)


def tpe(tmp_path: Path, names: list[str]) -> sweeps.Sweep:
    """A tpe sweep (2 at once) whose round 0 suggested ``names``."""
    found = parse(name="t", method="tpe", trials=4, max_parallel=2,
                  parameters={"train.lr": {"low": 0.01, "high": 0.1}})  # fmt: skip
    entries = [{"name": n, "values": {"train.lr": 0.01}, "number": i} for i, n in enumerate(names)]
    (tmp_path / "rounds").mkdir()
    (tmp_path / "rounds/0.json").write_text(json.dumps({"round": 0, "trials": entries}))
    return found


def test_a_round_takes_the_slot_that_frees_first(tmp_path: Path, holder) -> None:
    found, results = tpe(tmp_path, ["lr=0.01", "lr=0.02"]), tmp_path / "results"
    first, second = (state_of(results, sweeps.run_name("t", n)) for n in ("lr=0.01", "lr=0.02"))
    holder(first)  # the first trains on
    proc = holder(second)
    ends = threading.Timer(0.5, proc.communicate, [""])  # the second ends after 0.5 s
    ends.start()
    slot(second, "crashed", 1)
    freed = slots.wait(found, 1, tmp_path / "rounds", results, poll_s=0.05)
    ends.join()  # its communicate done, before the fixture's own on the same process
    assert freed.ended == ["lr=0.02"] and not freed.idle
    assert 0.4 < freed.waited_s < 3, freed


def test_a_round_waits_no_longer_once_nothing_trains(tmp_path: Path) -> None:
    """Both trials wait for a next slot (exit 75) that does not come in time: suggested."""
    found, results = tpe(tmp_path, ["lr=0.01", "lr=0.02"]), tmp_path / "results"
    for name in ("lr=0.01", "lr=0.02"):
        slot(state_of(results, sweeps.run_name("t", name)), "time limit", 75)
    freed = slots.wait(found, 1, tmp_path / "rounds", results, poll_s=0.05, idle_s=0.3)
    assert freed.idle and freed.ended == []
    assert "no training ran" in freed.words()
