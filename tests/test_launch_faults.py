"""Faults around a local training: a second training on the same state folder, signals while
a rank starts up, a stop under torchrun's --max-restarts."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddppipe.runstate import attempts, preemption
from ddppipe.runstate.state import StateDir
from tests.processes import start_guarded_launch, worker_pids
from tests.test_train_ddp import cli_args
from tests.tiny import TinyData, make_tiny, tiny_config


def long_config(tiny: TinyData, **train: object) -> dict:
    return tiny_config(tiny, epochs=20, batch_size=16, **train)  # long enough to signal


def test_a_second_training_on_a_locked_state_fails_at_once(tmp_path: Path) -> None:
    tiny = make_tiny(tmp_path / "tiny", n_train=1920)
    args = cli_args(long_config(tiny), tiny, tmp_path / "run")
    first, log = start_guarded_launch(args, tmp_path / "run")
    try:
        started = time.monotonic()
        second = subprocess.run(
            [sys.executable, "-m", "ddppipe", "launch", *args], cwd=tmp_path / "run",
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert time.monotonic() - started < 15
        assert second.returncode == 2, second.stderr
        holder = json.loads((tmp_path / "run/state/.lock").read_text())
        assert holder == {**holder, "pid": first.pid, "host": socket.gethostname(), "job": "local"}
        assert "is in use by another training" in second.stderr
        assert f'"pid": {first.pid}' in second.stderr, second.stderr
    finally:
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=120) == preemption.EXIT_CODE, log.read_text()
    history = attempts.load(StateDir(tmp_path / "run/state"))
    assert len(history) == 1  # the refused one left no record


@pytest.mark.slow  # 10 s on 2 cores
def test_a_signal_during_start_up_is_not_lost(tmp_path: Path) -> None:
    """SIGUSR1 to the workers as soon as they catch it, while they still import torch, join
    the process group and load data: they train to their first step check, checkpoint, stop."""
    tiny = make_tiny(tmp_path / "tiny", n_train=1920)
    run_dir = tmp_path / "run"
    args = cli_args(long_config(tiny), tiny, run_dir)
    proc, log = start_guarded_launch(args, run_dir, poll_s=0.02)
    workers = worker_pids(run_dir)
    assert "backend gloo" not in log.read_text()  # still starting up
    for pid in workers:
        os.kill(pid, signal.SIGUSR1)
    assert proc.wait(timeout=120) == preemption.EXIT_CODE, log.read_text()
    history = attempts.load(StateDir(run_dir / "state"))
    assert [a.outcome for a in history] == ["stopped on SIGUSR1"], log.read_text()
    assert history[0].checkpoint == "ckpt-e0000-s000010" and history[0].steps == 10


@pytest.mark.slow  # 10 s on 2 cores
def test_a_stop_is_never_restarted_in_place_by_max_restarts(tmp_path: Path) -> None:
    """torchrun restarts failed workers; a stop on a signal is not a failure."""
    tiny = make_tiny(tmp_path / "tiny", n_train=1920)
    cfg = long_config(tiny)
    cfg["launch"]["max_restarts"] = 2
    run_dir = tmp_path / "run"
    proc, log = start_guarded_launch(cli_args(cfg, tiny, run_dir), run_dir)
    time.sleep(1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == preemption.EXIT_CODE, log.read_text()
    text = log.read_text()
    assert text.count("rank 0/2") == 1, text  # one start of the worker group, no restart
    assert [a.outcome for a in attempts.load(StateDir(run_dir / "state"))] == ["stopped on SIGTERM"]
