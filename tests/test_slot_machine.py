"""The slot machine as tables: event sequences -> the slot's outcome, exit status and actions.

Pure (ddppipe.launching.slot_machine): no process, no file, no SLURM; each row runs in well
under a millisecond. The faults themselves, with real processes and the SLURM test cluster,
are tests/test_faults_*.py, tests/test_slurm_spare_nodes.py and tests/test_launch_faults.py.
"""

from __future__ import annotations

import logging
import signal
import typing

import pytest

from ddppipe.launching import slot_machine as sm
from ddppipe.runstate import restarts
from ddppipe.runstate.attempts import Attempt
from ddppipe.runstate.failures import AGENT_RANK, Failure
from ddppipe.slurm import scontrol
from tests.tiny import REPO

END = "2026-12-07T12:00:00"  # the job's time limit (scontrol's local time)
NEAR_END = scontrol.timestamp(END) - 80  # 80 s before it: a 60 s warning's stop
RUNNING = {"JobState": "RUNNING", "EndTime": END}
UP = {"cn1": "MIXED", "cn2": "MIXED"}
CHECKPOINT = {"signal": "SIGUSR1", "checkpoint": "epoch-3.pt"}
HANG = {"hung": {"detail": "rank 1 (cn2) in all_reduce for 310 s"}}
LOCAL = sm.SlotState(None, False, ("laptop",))
OWN = sm.SlotState("9", True, ("cn1", "cn2"), stop_signal="SIGUSR1", signal_seconds=60,
                   max_continuations=5, max_excluded_nodes=2)  # fmt: skip
SPARE = sm.SlotState("9", True, ("cn1", "cn2"), goes_on_in_job=True, max_continuations=5,
                     max_excluded_nodes=2)  # fmt: skip
PACKED = sm.SlotState("40", False, ("cn1",))


def attempt(number: int, outcome: str = "running", steps: int = 100, **kw: object) -> Attempt:
    return Attempt(number, "9", 0, ["cn1", "cn2"], 0.0, outcome=outcome, start_step=100 * number,
                   end_step=100 * number + steps, **kw)  # type: ignore[arg-type]  # fmt: skip


def crash(**kw: object) -> Failure:
    fields = {"rank": 1, "host": "cn2", "time": 1.0, "type": "RuntimeError", "message": "boom",
              "frame": "task.py:31 (in forward)", "step": 8, "epoch": 1, "restart": 0,
              "traceback": "Traceback ...", **kw}  # fmt: skip
    return Failure(**fields)  # type: ignore[arg-type]


OOM = crash(memory={"kind": "GPU", "peak": 80.0, "total": 80.0}, type="OutOfMemoryError")
NAN = crash(type="NonFiniteLoss", message="non-finite loss at step 3 (epoch 1)", step=3)
RDZV = crash(rank=AGENT_RANK, type="RendezvousTimeoutError", step=None, frame=None)


def facts(*history: Attempt, **kw: object) -> sm.Facts:
    """What the launcher found as the step ended, 80 s before the job's END by default."""
    return sm.Facts(history or (attempt(1),), **{"now": NEAR_END, **kw})  # type: ignore[arg-type]


def play(slot: sm.SlotState, *events: sm.Event) -> tuple[sm.SlotState, list[list[str]]]:
    """The slot after ``events`` and each event's actions, by name."""
    said = []
    for event in events:
        slot, actions = sm.step(slot, event)
        said.append([type(a).__name__ for a in actions])
    return slot, said


def ended(slot: sm.SlotState, exited: sm.Exited) -> tuple[str, int | None, list[str]]:
    """(the attempt's outcome, the launcher's exit status, the actions) of the step's end."""
    after, actions = sm.step(slot, exited)
    (finish,) = [a for a in actions if isinstance(a, sm.Finish)]
    assert after.phase is sm.Phase.ENDED
    return finish.outcome.label, after.exit_status, [type(a).__name__ for a in actions]


def at_end(code: int, note: dict | None, f: sm.Facts, checks: tuple[str, ...] = ()) -> sm.Exited:
    return sm.Exited(code, note, f, checks)


ENDS = [
    # local slots
    ("completed", LOCAL, at_end(0, None, facts()), ("completed", 0, ["Publish", "Finish"])),
    ("killed, no record", LOCAL, at_end(137, None, facts()),
     ("crashed (exit 137)", 137, ["Finish"])),
    ("a crash", LOCAL, at_end(1, None, facts(failure=crash())),
     ("crashed (exit 1)", 1, ["Say", "Finish"])),
    ("out of memory", LOCAL, at_end(1, None, facts(failure=OOM)),
     ("out of memory", 1, ["Say", "Finish"])),
    ("the same crash twice ends the run", LOCAL,
     at_end(1, None, facts(attempt(1, "crashed (exit 1)", failure=vars(crash())), attempt(2),
                           failure=crash())),
     ("crashed (exit 1)", 1, ["Say", "Finish", "Finalize", "Say"])),
    ("a non-finite loss ends the run at once", LOCAL, at_end(1, None, facts(failure=NAN)),
     ("non-finite loss at step 3 (epoch 1)", 1, ["Say", "Finish", "Finalize", "Say"])),
    ("a rendezvous timeout twice goes on", LOCAL,
     at_end(1, None, facts(attempt(1, "rendezvous timeout", failure=vars(RDZV)), attempt(2),
                           failure=RDZV)),
     ("rendezvous timeout", 1, ["Say", "Finish"])),
    ("a local hang fails", LOCAL, at_end(137, HANG, facts()), ("hung", 1, ["Finish", "Say"])),
    ("a local stop goes on", LOCAL, at_end(75, CHECKPOINT, facts()),
     ("stopped on SIGUSR1", 75, ["Finish"])),
    ("a packed trial's hang fails", PACKED, at_end(137, HANG, facts(job=RUNNING, node_states=UP)),
     ("hung", 1, ["Finish", "Say"])),
    # SLURM: a stop, and what SLURM says of it
    ("the time limit requeues its job", OWN,
     at_end(75, CHECKPOINT, facts(job=RUNNING, node_states=UP)),
     ("time limit", 75, ["Finish", "Requeue"])),
    ("a node drained for maintenance leaves a time limit a time limit", OWN,
     at_end(75, CHECKPOINT, facts(job=RUNNING, node_states={**UP, "cn2": "MIXED+DRAIN"})),
     ("time limit", 75, ["Finish", "Requeue"])),
    ("a node down makes it a node failure, SLURM's to requeue", OWN,
     at_end(75, CHECKPOINT, facts(job=RUNNING, node_states={**UP, "cn2": "DOWN+DRAIN"})),
     ("node failure", 75, ["Finish", "Say"])),
    ("preempted", OWN, at_end(75, {**CHECKPOINT, "signal": "SIGTERM"},
                              facts(job={**RUNNING, "JobState": "PREEMPTED"}, node_states=UP)),
     ("preempted", 75, ["Finish", "Say"])),
    ("a failed job query is a cause unknown, not a user's stop", OWN,
     at_end(75, CHECKPOINT, facts(job={}, node_states=UP)),
     ("stopped on SIGUSR1 (cause unknown: scontrol show job failed)", 75,
      ["Finish", "Requeue"])),
    ("no new step checkpointed: no progress", OWN,
     at_end(75, CHECKPOINT, facts(attempt(1, steps=0), job=RUNNING, node_states=UP)),
     ("time limit", 1, ["Finish", "Say"])),
    ("a hang goes on once", OWN, at_end(137, HANG, facts(attempt(1, steps=0), job=RUNNING)),
     ("hung", 75, ["Finish", "Requeue"])),
    ("a second hang without progress ends the run", OWN,
     at_end(137, HANG, facts(attempt(1, "hung", steps=0), attempt(2, steps=0), job=RUNNING)),
     ("hung", 1, ["Finish", "Say"])),
    ("a hang outranks the ranks' stop note", OWN,
     at_end(137, {**CHECKPOINT, **HANG}, facts(job=RUNNING, node_states=UP)),
     ("hung", 75, ["Finish", "Requeue"])),
    # SLURM: srun's exit 0 without every node's finished mark
    ("a late mark: srun's exit 0 stands", OWN,
     at_end(0, {"signal": None, "checkpoint": None, "unfinished": ["cn2"]},
            facts(job=RUNNING, node_states=UP)),
     ("completed", 0, ["Say", "Publish", "Finish"])),
    ("SLURM ending the job", OWN,
     at_end(0, {"signal": None, "checkpoint": None, "unfinished": ["cn2"]},
            facts(job={"JobState": "CANCELLED"}, node_states=UP)),
     ("ended by SLURM", 75, ["Finish", "Say"])),
    ("the step failed on a node SLURM sees down", OWN,
     at_end(1, None, facts(job=RUNNING, node_states={**UP, "cn2": "DOWN"})),
     ("node failure", 75, ["Finish", "Say"])),
    ("a crash on SLURM", OWN, at_end(1, None, facts(job=RUNNING, node_states=UP,
                                                   failure=crash())),
     ("crashed (exit 1)", 1, ["Say", "Finish"])),
    # a lost node, a node's failed checks
    ("a lost node: the job goes on without it", SPARE,
     at_end(137, {"signal": None, "checkpoint": None, "lost": ["cn2"], "detail": "cn2: silent"},
            facts()),
     ("node failure", 75, ["RecordBadNodes", "Finish", "GoOn"])),
    ("a lost node outranks a hang", SPARE,
     at_end(137, {**HANG, "lost": ["cn2"], "detail": "cn2: silent"}, facts()),
     ("node failure", 75, ["RecordBadNodes", "Finish", "GoOn"])),
    ("a bad node without a spare ends the job", OWN,
     at_end(3, None, facts(), ("preflight: cn2: no usable GPU",)),
     ("bad node cn2", 3, ["RecordBadNodes", "Finish", "Refuse"])),
    ("a bad node with a spare: the job goes on", SPARE,
     at_end(3, None, facts(), ("preflight: cn2: no usable GPU",)),
     ("bad node cn2", 3, ["RecordBadNodes", "Finish", "GoOn"])),
    ("a spare that fails its checks too: the next", SPARE,
     at_end(3, None, facts(excluded=("cn3",)), ("preflight: cn2: no usable GPU",)),
     ("bad node cn2", 3, ["RecordBadNodes", "Finish", "GoOn"])),
    ("past slurm.max_excluded_nodes: not excluded, the job ends", SPARE,
     at_end(3, None, facts(excluded=("cn3", "cn4")), ("preflight: cn2: no usable GPU",)),
     ("failed its checks (cn2)", 3, ["Say", "Finish", "Refuse"])),
    ("every node failed: the run's problem", SPARE,
     at_end(3, None, facts(), ("preflight: cn1: no GPU", "preflight: cn2: no GPU")),
     ("failed its checks (cn1, cn2)", 3, ["Say", "Finish", "Refuse"])),
]  # fmt: skip


@pytest.mark.parametrize(("slot", "exited", "expected"), [row[1:] for row in ENDS],
                         ids=[row[0] for row in ENDS])  # fmt: skip
def test_how_a_slot_ends(slot: sm.SlotState, exited: sm.Exited, expected: tuple) -> None:
    """(the slot, its step's exit, what the launcher found) -> (outcome, exit, actions)."""
    assert ended(slot, exited) == expected


def test_the_stop_and_its_requeue_say_what_they_resume_from() -> None:
    _, actions = sm.step(OWN, at_end(75, CHECKPOINT, facts(job=RUNNING, node_states=UP)))
    assert actions[-1] == sm.Requeue("9", "epoch-3.pt")
    _, actions = sm.step(SPARE, at_end(3, None, facts(), ("preflight: cn2: no usable GPU",)))
    go_on = actions[-1]
    assert isinstance(go_on, sm.GoOn) and go_on.nodes == ("cn2",)
    assert go_on.otherwise == sm.Refuse("the slot's checks failed:\n  cn2: no usable GPU",
                                        ("cn2",))  # fmt: skip


def test_the_same_crash_twice_says_so_in_the_record() -> None:
    twice = facts(attempt(1, "crashed (exit 1)", failure=vars(crash())), attempt(2),
                  failure=crash())  # fmt: skip
    _, actions = sm.step(LOCAL, at_end(1, None, twice))
    finish = next(a for a in actions if isinstance(a, sm.Finish))
    assert finish.detail == (
        "rank 1 on cn2: RuntimeError: boom at task.py:31 (in forward), "
        "step 8 (epoch 1) (slots 1 and 2 failed the same way: not retried)"
    )


DURING = [
    ("the warning forwards the stop signal", OWN, [sm.Warned()],
     [["Say", "Forward"]], sm.Phase.RUNNING),
    ("a signal is forwarded", OWN, [sm.Signalled(signal.SIGTERM)], [["Forward"]],
     sm.Phase.RUNNING),
    ("a hang ends the step", OWN, [sm.Hung()], [["EndStep"]], sm.Phase.ENDING),
    ("a lost node ends the step", SPARE, [sm.NodeLost()], [["EndStep"]], sm.Phase.ENDING),
    ("one end at a time: a lost node after a hang", SPARE, [sm.Hung(), sm.NodeLost()],
     [["EndStep"], []], sm.Phase.ENDING),
    ("one end at a time: a hang after a lost node", SPARE, [sm.NodeLost(), sm.Hung()],
     [["EndStep"], []], sm.Phase.ENDING),
    ("no warning to a step being ended", OWN, [sm.Hung(), sm.Warned()], [["EndStep"], []],
     sm.Phase.ENDING),
    ("a signal still reaches a step being ended", OWN, [sm.Hung(), sm.Signalled(2)],
     [["EndStep"], ["Forward"]], sm.Phase.ENDING),
    ("nothing after the end", LOCAL, [at_end(0, None, facts()), sm.Signalled(15), sm.Warned()],
     [["Publish", "Finish"], [], []], sm.Phase.ENDED),
]  # fmt: skip


@pytest.mark.parametrize(("slot", "events", "actions", "phase"), [row[1:] for row in DURING],
                         ids=[row[0] for row in DURING])  # fmt: skip
def test_events_while_the_step_runs(slot: sm.SlotState, events: list, actions: list,
                                    phase: sm.Phase) -> None:  # fmt: skip
    after, said = play(slot, *events)
    assert (said, after.phase) == (actions, phase)


def test_the_warning_is_the_configured_stop_signal() -> None:
    _, actions = sm.step(sm.SlotState(None, False, (), stop_signal="SIGUSR2"), sm.Warned())
    assert actions == [sm.Say(logging.WARNING, "time-limit warning: SIGUSR2 to the training"),
                       sm.Forward(signal.SIGUSR2)]  # fmt: skip


ASKS = [  # (slot, code, note, checks) -> does the end depend on SLURM's word?
    (LOCAL, 1, None, [], False),
    (OWN, 0, None, [], False),  # completed
    (OWN, 1, None, [], True),  # a failed step: a node down?
    (OWN, 75, CHECKPOINT, [], True),  # a stop: a time limit, preemption?
    (OWN, 0, {"unfinished": ["cn2"]}, [], True),  # a missing mark: is SLURM ending the job?
    (OWN, 3, None, ["preflight: cn2: x"], False),  # a node's own checks failed
    (SPARE, 137, {"lost": ["cn2"]}, [], False),  # a lost node
    (PACKED, 75, CHECKPOINT, [], True),
]  # fmt: skip


@pytest.mark.parametrize(("slot", "code", "note", "checks", "asks"), ASKS)
def test_slurm_is_asked_only_where_the_end_depends_on_it(slot, code, note, checks, asks):
    assert sm.asks_slurm(slot, code, note, checks) is asks


LAUNCHER_LOST = [  # a launcher killed without a word, as SLURM tells it at the next slot
    ({"cn07": "DOWN+DRAIN"}, True, "node failure"),
    ({"cn07": "IDLE+NOT_RESPONDING"}, False, "node failure"),
    # a drained node alone kills no launcher (administrators drain nodes with running jobs),
    # nor one an administrator expects to fail
    ({"gpu-a12": "IDLE+DRAIN"}, False, None),
    ({"gpu-a12": "MIXED+DRAIN"}, True, "requeued by SLURM"),
    ({"cn07": "MIXED+FAIL"}, False, None),
    # slurmd drained it: the job's processes would not die (its Reason "Kill task failed")
    ({"cn07": "MIXED+DRAIN+KILL_TASK_FAILED"}, False, "node failure"),
    ({"cn07": "MIXED"}, True, "requeued by SLURM"),
    ({"cn07": "MIXED"}, False, None),  # (an OOM, a SIGKILL: lost)
    ({}, False, None),  # (scontrol could not say)
]  # fmt: skip


@pytest.mark.parametrize(("nodes", "requeued", "outcome"), LAUNCHER_LOST)
def test_a_slot_whose_launcher_died_is_named_by_what_slurm_says(nodes, requeued, outcome):
    assert sm.lost(nodes, requeued) == outcome


def test_a_stop_an_hour_before_the_jobs_end_is_a_users() -> None:
    early = facts(job=RUNNING, node_states=UP, now=NEAR_END - 3600)
    assert ended(OWN, at_end(75, CHECKPOINT, early)) == ("stopped on SIGUSR1", 75,
                                                         ["Finish", "Requeue"])  # fmt: skip


def _first_line(cls: type) -> str:
    return " ".join((cls.__doc__ or "").split("\n\n")[0].split()).replace("``", "`")


def state_table() -> str:
    """The slot's states, events, order of end causes and restart budgets, in Markdown, from
    the code (docs/training.md holds it between its ``slot-table`` marks)."""
    lines = ["| State | |", "| --- | --- |"]
    lines += [f"| `{phase}` | {text} |" for phase, text in sm.PHASES.items()]
    lines += ["", "| Event | Posted by, and what |", "| --- | --- |"]
    lines += [f"| `{e.__name__}` | {_first_line(e)} |" for e in typing.get_args(sm.Event)]
    lines += ["", "The order of end causes (the first that holds names the slot's end):", ""]
    lines += [f"{n}. **{cause}**: {text}" for n, (cause, text) in enumerate(sm.CAUSES, 1)]
    lines += ["", "| Restart budget | Sized by | Covers | Who restarts |", "| --- " * 4 + "|"]
    lines += [f"| {b.name} | `{b.setting}` | {b.faults} | {b.who} |" for b in restarts.RESTARTS]
    return "\n".join([*lines, "", f"Across all of them: {restarts.SAME_TWICE}."])


def test_the_docs_state_table_is_the_codes() -> None:
    """docs/training.md's table of the slot's states, events, causes and restarts is the
    one the code has (on a change: paste this test's expected text into the docs)."""
    text = (REPO / "docs/training.md").read_text()
    _, _, rest = text.partition("<!-- slot-table -->\n")
    shown, _, _ = rest.partition("\n<!-- /slot-table -->")
    assert shown == state_table()
