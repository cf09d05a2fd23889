"""Goodput: the share of the node time held that trained kept steps, and where the rest went,
from attempt records built by hand (every expected figure worked out in the comments)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddppipe.reports import goodput, summary, summary_html
from ddppipe.runstate.attempts import LOST
from tests.test_summary import _Cells, make_run


def figures(startup: float, train: float, steps: int, evaluate: float = 0.0,
            checkpoint: float = 0.0) -> dict:  # fmt: skip
    return {"startup_s": startup, "train_s": train, "steps": steps, "evaluate_s": evaluate,
            "checkpoint_s": checkpoint, "data_s": 1.0}  # fmt: skip


# Two 2-node slots of SLURM job 7 across a time limit, the second after a requeue (queued
# 500 s: not held). Slot 1 trained 500 steps in 800 s (1.6 s a step) but checkpointed step
# 400 last, where slot 2 resumed: 100 steps (160 s) redone.
TIME_LIMIT = [
    {"number": 1, "job": "7", "restarts": 0, "nodes": ["a", "b"], "start": 0.0, "end": 1000.0,
     "outcome": "time limit", "start_step": 0, "end_step": 400,
     "efficiency": figures(60.0, 800.0, 500, evaluate=40.0, checkpoint=20.0)},
    {"number": 2, "job": "7", "restarts": 1, "nodes": ["a", "b"], "start": 1500.0,
     "end": 2000.0, "outcome": "completed", "start_step": 400, "end_step": 800,
     "efficiency": figures(50.0, 400.0, 400, evaluate=20.0, checkpoint=10.0)},
]  # fmt: skip


def test_two_slots_across_a_time_limit() -> None:
    run = goodput.account(TIME_LIMIT)
    assert run is not None
    # slot 1 (x 2 nodes): 1000 s held; kept 400 steps = 640 s; the rest: start-up 60,
    # redone 160, evaluation 40, checkpoints 20, idle end 1000 - 640 - 280 = 80
    one, two = (a for _, a in run.slots)
    assert one.held == 2000.0 and one.kept == pytest.approx(1280.0)
    assert one.losses == pytest.approx({"startup": 120.0, "redone": 320.0, "evaluation": 80.0,
                                        "checkpoint": 40.0, "idle_end": 160.0})  # fmt: skip
    assert one.redone_steps == 100 and one.share == pytest.approx(0.64)
    # slot 2: 500 s held, all 400 steps kept (400 s); idle end 500 - 400 - 50 - 20 - 10 = 20
    assert two.held == 1000.0 and two.kept == pytest.approx(800.0)
    assert two.losses == pytest.approx({"startup": 100.0, "evaluation": 40.0,
                                        "checkpoint": 20.0, "idle_end": 40.0})  # fmt: skip
    # the run: 3000 node-s held (the queue between the slots is not), 2080 kept
    total = run.total
    assert (total.held, total.redone_steps) == (3000.0, 100)
    assert total.share == pytest.approx(2080 / 3000)
    assert total.largest() == ("redone", pytest.approx(320.0))
    assert goodput.line(run) == (
        "69% of the 50.0 min of node time held trained kept steps; largest loss: steps redone "
        "11% (then start-up 7%, idle end of a slot 7%, evaluation 4%, checkpoint blocking 2%); "
        "100 steps redone; by slot 1: 64%, 2: 80%"
    )


def test_a_hung_slot_then_a_new_step_in_the_same_job() -> None:
    """The hung slot recorded no figures: its checkpointed 100 steps are kept at the run's
    1.5 s a step (slot 2: 300 s for 200 steps), the rest of its 600 s is the hang; the 30 s
    between the slots held the job's node (a restart, not a requeue)."""
    attempts = [
        {"number": 1, "job": "9", "restarts": 0, "nodes": ["a"], "start": 0.0, "end": 600.0,
         "outcome": "hung", "start_step": 0, "end_step": 100},
        {"number": 2, "job": "9", "restarts": 0, "nodes": ["a"], "start": 630.0,
         "end": 1030.0, "outcome": "completed", "start_step": 100, "end_step": 300,
         "efficiency": figures(30.0, 300.0, 200)},
    ]  # fmt: skip
    run = goodput.account(attempts)
    assert run is not None
    # held 600 + 30 + 400 = 1030; kept 150 + 300 = 450; slot 2's idle end 400 - 300 - 30
    assert run.total.held == 1030.0 and run.total.kept == pytest.approx(450.0)
    assert run.total.losses == pytest.approx({"hang": 450.0, "restart": 30.0, "startup": 30.0,
                                              "idle_end": 70.0})  # fmt: skip
    assert goodput.line(run).startswith(
        "44% of the 17.2 min of node time held trained kept steps; largest loss: loader or "
        "rank hang (watchdog end) 44%"
    )


def test_a_resume_from_an_older_checkpoint_and_a_lost_slot() -> None:
    """Slot 2 resumed from step 30 although slot 1 checkpointed step 40: slot 1 keeps 30 of
    its 50 steps (48 of 80 s). Slot 2's launcher was killed (no end, no figures): it ended
    when its job was requeued (slot 3's submission, 260) and kept steps 30 to 50 (slot 3's
    resume), 20 at the run's 1.6 s a step (160 s for 100 steps)."""
    attempts = [
        {"number": 1, "job": "5", "restarts": 0, "nodes": ["a"], "start": 0.0, "end": 100.0,
         "outcome": "time limit", "start_step": 0, "end_step": 40,
         "efficiency": figures(10.0, 80.0, 50)},
        {"number": 2, "job": "5", "restarts": 1, "nodes": ["a"], "start": 200.0, "end": None,
         "outcome": LOST, "start_step": 30, "end_step": 60},
        {"number": 3, "job": "5", "restarts": 2, "nodes": ["a"], "submitted": 260.0,
         "start": 300.0, "end": 400.0, "outcome": "completed", "start_step": 50,
         "end_step": 100, "efficiency": figures(20.0, 80.0, 50)},
    ]  # fmt: skip
    run = goodput.account(attempts)
    assert run is not None
    assert [n for n, _ in run.slots] == [1, 2, 3]
    # held 100 + 60 + 100; kept 48 + 32 + 80; slot 1: redone 32, idle end 100 - 48 - 32 - 10
    assert run.total.held == 260.0 and run.total.kept == pytest.approx(160.0)
    assert run.total.losses == pytest.approx({"startup": 30.0, "redone": 32.0,
                                              "idle_end": 10.0, "failure": 28.0})  # fmt: skip
    assert run.total.redone_steps == 20


def test_a_crashed_slot_redid_the_steps_after_its_last_checkpoint() -> None:
    """Rank 1 crashed in step 70 (69 done) after the checkpoint at step 60, where slot 2
    resumed: 60 steps kept and 9 redone, at the run's 2 s a step (slot 2: 80 s for 40)."""
    attempts = [
        {"number": 1, "job": "local", "nodes": ["a"], "start": 0.0, "end": 200.0,
         "outcome": "crashed (exit 1)", "start_step": 0, "end_step": 60,
         "failure": {"rank": 1, "step": 70}},
        {"number": 2, "job": "local", "nodes": ["a"], "start": 250.0, "end": 400.0,
         "outcome": "completed", "start_step": 60, "end_step": 100,
         "efficiency": {**figures(30.0, 80.0, 40), "communication_probe_s": 5.0}},
    ]  # fmt: skip
    run = goodput.account(attempts)
    assert run is not None
    # slot 1: 120 s kept, 18 s redone, 200 - 138 = 62 s lost to the crash; the 50 s between
    # local launches held nothing; slot 2: 80 s kept, idle end 150 - 80 - 30 - 5 = 35
    assert run.slots[0][1].losses == pytest.approx({"redone": 18.0, "failure": 62.0})
    assert run.total.held == 350.0 and run.total.kept == pytest.approx(200.0)
    assert run.total.losses == pytest.approx({"redone": 18.0, "failure": 62.0,
                                              "startup": 30.0, "probe": 5.0,
                                              "idle_end": 35.0})  # fmt: skip
    assert run.total.redone_steps == 9


def test_nothing_to_account_before_a_slot_recorded_its_figures() -> None:
    running = {"number": 1, "job": "local", "nodes": ["a"], "start": 0.0, "end": None,
               "outcome": "running"}  # fmt: skip
    assert goodput.account([running]) is None
    assert goodput.account([{**running, "outcome": "crashed (exit 1)", "end": 50.0}]) is None
    # a slot still training is left out of a run that has a finished one
    run = goodput.account([TIME_LIMIT[0], {**running, "number": 2, "start": 1500.0}])
    assert run is not None and [n for n, _ in run.slots] == [1]


def test_the_summary_and_its_html_show_the_goodput(tmp_path: Path) -> None:
    """The summary's fixture run, its two 4-minute slots given figures: slot 1 trained 100
    steps in 120 s, checkpointed 80, and slot 2 resumed there: 96 s kept, 24 s redone."""
    import json

    run_dir = make_run(tmp_path)
    path = run_dir / "train" / "attempts.json"
    attempts = json.loads(path.read_text())
    attempts[0].update(job="local", start_step=0, end_step=80, efficiency=figures(20.0, 120.0, 100))
    attempts[1].update(
        job="local", start_step=80, end_step=180, efficiency=figures(10.0, 100.0, 100)
    )
    path.write_text(json.dumps(attempts))
    # held 200 + 150 s (one node each); kept 96 + 100; idle ends 200 - 140 and 150 - 110
    expected = ("56% of the 5.8 min of node time held trained kept steps; largest loss: idle "
                "end of a slot 29% (then start-up 9%, steps redone 7%); 20 steps redone; by "
                "slot 1: 48%, 2: 67%")  # fmt: skip
    found = summary.build(run_dir)
    assert ("goodput", expected) in found.lines
    parser = _Cells()
    parser.feed(summary_html.render(found))
    assert parser.cells[parser.cells.index("goodput") + 1] == expected


def test_the_attempts_table_has_each_slots_goodput(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`ddppipe attempts` (and its HTML page): the two slots across a time limit, 64 % and
    80 % (worked out above), in a last column."""
    import json

    from ddppipe.cli.commands import runstate

    history = tmp_path / "attempts.json"
    history.write_text(json.dumps(TIME_LIMIT))
    assert runstate.attempts(history, "mine", None) == 0
    header, *rows = capsys.readouterr().out.splitlines()
    assert header.split()[-1] == "goodput"
    assert [row.split()[-1] for row in rows] == ["64%", "80%"]
    assert runstate.attempts(history, "mine", tmp_path / "attempts.html") == 0
    parser = _Cells()
    parser.feed((tmp_path / "attempts.html").read_text())
    assert parser.cells[-1] == "80%"
