"""A slot's start-up in parts: the processes' clock readings (ddppipe.core.process_times),
the parts derived from them (ddppipe.runstate.startup), the attempt record and the summary's
line. In-process; the real marks of a launch: test_train_ddp.py, test_slurm.py."""

import subprocess
import time
from pathlib import Path

import pytest

from ddppipe.core import process_times
from ddppipe.reports import goodput, slot_lines
from ddppipe.runstate import attempts, startup
from ddppipe.runstate.state import StateDir

# A SLURM slot of 2 nodes in a container, its job started at 1000.0 (offsets below)
SLURM_MARKS = {
    "launcher_process": 1.5, "launcher_ranks_launched": 9.25, "agent_container": 9.5,
    "agent_process": 10.0,
    "agent_entered": 10.25, "agent_imported": 13.0, "rank_container": 9.5,  # the agent's
    "rank_process": 14.0, "rank_entered": 14.25, "rank_imported": 17.0,
    "rank_process_group": 17.5, "rank_checks": 17.75, "rank_data": 18.0, "rank_model": 18.5,
    "rank_resumed": 19.0,
    "rank_first_step": 20.0,
}  # fmt: skip


def at(start: float, offsets: dict[str, float]) -> dict[str, float]:
    return {k: start + v for k, v in offsets.items()}


def test_a_slurm_slots_parts_from_its_jobs_start() -> None:
    parts = startup.parts(1000.0, at(1000.0, SLURM_MARKS))
    assert parts == {
        "job to launcher": 1.5, "launcher": 7.75, "launch": 0.25,
        "container": 0.5, "interpreter": 0.25 + 0.25, "imports": 2.75 + 2.75,
        "rendezvous": 1.0, "process group": 0.5, "checks": 0.25, "data": 0.25, "model": 0.5,
        "checkpoint load": 0.5, "first step": 1.0,
    }  # fmt: skip
    assert startup.from_job(parts) and sum(parts.values()) == 20.0
    assert startup.before_first_step(parts) == 19.0


def test_a_local_slots_parts_name_the_fork_and_a_containers_start() -> None:
    local = {"launcher_ranks_launched": 0.5, "rank_process": 0.75, "rank_entered": 1.0,
             "rank_imported": 4.0, "rank_process_group": 4.25, "rank_first_step": 6.0}  # fmt: skip
    assert startup.parts(50.0, at(50.0, local)) == {
        "launcher": 0.5, "launch": 0.25, "interpreter": 0.25, "imports": 3.0,
        "process group": 0.25, "first step": 1.75,
    }  # fmt: skip
    boxed = {**local, "rank_container": 0.625}  # the rank's Python started by Apptainer
    parts = startup.parts(50.0, at(50.0, boxed))
    assert (parts["launch"], parts["container"]) == (0.125, 0.125)
    assert not startup.from_job(parts)


def test_a_mark_before_the_one_before_counts_nothing_and_missing_marks_merge() -> None:
    skewed = {"launcher_ranks_launched": 2.0, "rank_process": 1.0, "rank_first_step": 3.0}
    assert startup.parts(0.0, skewed) == {"launcher": 2.0, "launch": 0.0, "first step": 1.0}


def test_the_slot_starts_with_its_job_else_its_launcher() -> None:
    assert startup.slot_start(now=30.0, launcher=12.0, job=10.0) == 10.0
    assert startup.slot_start(now=30.0, launcher=12.0, job=None) == 12.0
    assert startup.slot_start(now=30.0, launcher=None, job=None) == 30.0
    assert startup.slot_start(now=30.0, launcher=9.0, job=10.0) == 9.0  # (a second's rounding)


def test_the_attempt_record_takes_the_parts_and_the_start_up_figure(tmp_path: Path) -> None:
    state = StateDir(tmp_path / "state")
    base = time.time() - 9.25  # its job's start: the ranks are launched now
    launcher = at(base, {"launcher_process": 1.5})
    (opened,) = attempts.begin(state, "77", 0, ["n1", "n2"], marks=launcher, job_start=base)
    assert opened.start == base and opened.marks == launcher
    attempts.mark(state, "launcher_ranks_launched")
    ranks = {k: v for k, v in at(base, SLURM_MARKS).items() if not k.startswith("launcher")}
    attempts.write_progress(state, {"start_step": 0, "end_step": 8, "efficiency": {
        "steps": 8, "train_s": 4.0, "startup_s": 99.0, "startup_marks": ranks}})  # fmt: skip
    (closed,) = attempts.finish(state, "completed", 0)
    assert closed.startup is not None and closed.efficiency is not None
    assert closed.startup["job to launcher"] == 1.5 and 7.75 <= closed.startup["launcher"] < 8.0
    assert 0 < closed.startup["launch"] <= 0.25  # from the launcher's mark, taken now
    assert "startup_marks" not in closed.efficiency  # kept as the record's marks
    assert closed.efficiency["startup_s"] == pytest.approx(19.0)  # to the first step's start
    assert closed.marks is not None and closed.marks["rank_first_step"] == base + 20.0


def test_goodput_counts_the_parts_start_up_from_the_jobs_start(tmp_path: Path) -> None:
    state = StateDir(tmp_path / "state")
    attempts.begin(state, "77", 0, ["n1", "n2"], marks=at(1000.0, {"launcher_process": 1.5}),
                   job_start=1000.0)  # fmt: skip
    attempts.write_progress(state, {"start_step": 0, "end_step": 8, "efficiency": {
        "steps": 8, "train_s": 30.0, "startup_marks": at(1000.0, SLURM_MARKS)}})  # fmt: skip
    (closed,) = attempts.finish(state, "completed", 0)
    record = vars(closed) | {"end": 1050.0}
    account = goodput.slot(record, None, None)
    assert account is not None
    assert account.held == 2 * 50.0  # from the job's start, 2 nodes
    assert account.losses["startup"] == 2 * 19.0 and account.kept == 2 * 30.0


def test_a_later_slot_of_the_same_job_starts_with_its_launcher(tmp_path: Path) -> None:
    state = StateDir(tmp_path / "state")
    attempts.begin(state, "77", 0, ["n1"], job_start=time.time() - 60)
    attempts.finish(state, "crashed (exit 1)", 1)
    marks = {"launcher_process": time.time() - 2}
    history = attempts.begin(state, "77", 0, ["n1"], marks=marks, job_start=time.time() - 60)
    assert history[-1].start == marks["launcher_process"] and history[-1].marks is None


def test_the_summary_line_names_the_parts_in_order() -> None:
    parts = startup.parts(1000.0, at(1000.0, SLURM_MARKS))
    record = {"number": 2, "startup": dict(sorted(parts.items()))}  # as its JSON holds it
    ((label, text),) = slot_lines.start_up([{"number": 1}, record])
    assert label == "start-up"
    assert text == (
        "first step done 20.0 s after its job started (slot 2): job to launcher 1.5 s, "
        "launcher 7.8 s, launch 0.2 s, container 0.5 s, interpreter 0.5 s, "
        "imports 5.5 s, rendezvous 1.0 s, process group 0.5 s, checks 0.2 s, data 0.2 s, "
        "model 0.5 s, "
        "checkpoint load 0.5 s, first step 1.0 s"
    )
    assert slot_lines.start_up([{"number": 1}]) == []  # a record of before: no line
    resumed_at_the_end = {"number": 1, "startup": {"launcher": 0.5, "checkpoint load": 1.0}}
    ((_, text),) = slot_lines.start_up([resumed_at_the_end])
    assert text == (
        "ready, no step trained, 1.5 s after its launcher started: launcher 0.5 s, "
        "checkpoint load 1.0 s"
    )


def test_a_processes_start_and_its_containers_from_proc(tmp_path: Path) -> None:
    """The kernel's start times, on the wall clock (to its ticks); a process under a runtime
    named like Apptainer's starter has that start as its container's."""
    starter = tmp_path / "starter"
    starter.symlink_to("/bin/sh")
    before = time.time()
    shell = subprocess.Popen([str(starter), "-c", "sleep 0.5; sleep 30; true"])
    try:
        time.sleep(1.0)
        child = subprocess.run(["pgrep", "-P", str(shell.pid)], capture_output=True, text=True)
        (sleep_pid,) = child.stdout.split()
        shell_start = process_times.started(shell.pid)
        assert shell_start is not None and before - 0.05 <= shell_start <= before + 0.5
        sleeper = process_times.started(sleep_pid)
        assert sleeper is not None and sleeper >= shell_start + 0.45
        assert process_times.container_started(sleep_pid) == pytest.approx(shell_start, abs=1e-3)
        assert process_times.container_started(shell.pid) is None  # its parent is pytest
    finally:
        shell.kill()
        shell.wait()
    assert process_times.started(2**22 + 7) is None  # no such process
    own = process_times.own("rank_")
    assert own["rank_process"] <= own["rank_entered"] <= time.time()
