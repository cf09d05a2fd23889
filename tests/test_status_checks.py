"""The SLURM plugin's status checks woken by a slot's end (ddppipe.slurm.executor.status_checks)."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import snakemake_executor_plugin_slurm
import snakemake_executor_plugin_slurm_jobstep

from ddppipe.launching import lifecycle
from ddppipe.runstate.state import StateDir
from ddppipe.slurm.executor import status_checks


def test_a_slot_end_cuts_the_sleep_short(tmp_path: Path) -> None:
    state = StateDir(tmp_path / "results/run/state")
    os.makedirs(state.root)
    # an end long ago (an earlier slot) does not shorten the plugin's interval
    lifecycle.mark_slot_end(state)
    os.utime(state.root / "slot-ended", (time.time() - 600, time.time() - 600))
    timer = threading.Timer(1.0, lifecycle.mark_slot_end, [state])
    timer.start()
    started = time.monotonic()
    asyncio.run(status_checks.sleep(60, lambda: status_checks.last_slot_end([state])))
    timer.join()
    assert time.monotonic() - started < 10  # the plugin's 60 s cut short by the slot's end


def test_checks_come_every_two_seconds_just_after_a_slot_end() -> None:
    now = 1_000_000.0
    assert status_checks.interval(62, now, last_end=now - 5) == 2
    assert status_checks.interval(1, now, last_end=now - 5) == 1
    assert status_checks.interval(62, now, last_end=now - 31) == 62
    assert status_checks.interval(62, now, last_end=0) == 62


def test_the_latest_end_of_any_run(tmp_path: Path) -> None:
    a, b = StateDir(tmp_path / "a/state"), StateDir(tmp_path / "b/state")
    assert status_checks.last_slot_end([a, b]) == 0
    lifecycle.mark_slot_end(a)
    os.utime(a.root / "slot-ended", (1_000, 1_000))
    lifecycle.mark_slot_end(b)
    os.utime(b.root / "slot-ended", (2_000, 2_000))
    assert status_checks.last_slot_end([a, b, StateDir(tmp_path / "c/state")]) == 2_000


def test_installs_on_the_pinned_slurm_plugin_only() -> None:
    executor = type("Executor", (snakemake_executor_plugin_slurm.Executor,), {})
    assert status_checks.install(executor, [StateDir(Path("results/run/state"))])
    assert executor.sleep is not snakemake_executor_plugin_slurm.Executor.sleep
    # an executor without the remote executor's sleep and interval: left as it is
    local = type("Executor", (snakemake_executor_plugin_slurm_jobstep.Executor,), {})
    assert not status_checks.install(local, [StateDir(Path("results/run/state"))])
    assert "sleep" not in vars(local)
