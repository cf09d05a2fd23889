"""The launcher's watch of a step's nodes (ddppipe.launching.node_watch): a node whose agent
went silent is lost, sooner when the step is ending anyway; a crash (every agent ended) is no
lost node; SLURM's word counts too, asked once a minute and at once when a node falls silent."""

from __future__ import annotations

import os
import pwd
from pathlib import Path

import pytest

from ddppipe.core import slot
from ddppipe.launching import node_watch
from ddppipe.runstate import node_beats
from ddppipe.runstate.node_beats import NodeRecord
from ddppipe.runstate.state import StateDir
from ddppipe.training.measuring import node_summary


def beat(state: StateDir, node: str, text: str) -> None:
    """``node``'s record of slot L: its count ``text``, or ``ended``."""
    state.node_beats.mkdir(parents=True, exist_ok=True)
    ended = text == "ended"
    NodeRecord("L", node, 99 if ended else int(text), ended).write(state.node_beats / node)


@pytest.fixture
def watch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> node_watch.NodeWatch:
    asked: list[list[str]] = []
    monkeypatch.setattr(
        node_watch.scontrol, "node_states",
        lambda nodes: asked.append(nodes) or dict.fromkeys(nodes, "MIXED"),
    )  # fmt: skip
    found = node_watch.NodeWatch(StateDir(tmp_path), "9", ["cn11", "cn12"])
    found.begin("L", now=0.0)
    return found


def test_a_silent_node_is_lost_sooner_when_the_step_ends_anyway(
    watch: node_watch.NodeWatch,
) -> None:
    for node in watch.hosts:
        beat(watch.state, node, "0")
    assert watch.check(now=0.5) == []
    beat(watch.state, "cn11", "1")
    assert watch.check(now=9.0) == []  # cn12 quiet 8.5 s, nothing else wrong
    assert watch.check(now=50.0) == []  # 49.5 s: under SILENT_ALONE_S
    beat(watch.state, "cn11", "ended")  # cn11's ranks failed (their peer gone): it exited
    assert watch.check(now=55.0) == ["cn12"]
    assert watch.why == "cn12: its agent silent 54 s after the step's other ranks failed or ended"
    assert watch.others_ended()  # nothing left to kill on cn11: only srun waits on


def test_a_crash_ends_every_agent_and_loses_no_node(watch: node_watch.NodeWatch) -> None:
    for node in watch.hosts:
        beat(watch.state, node, "0")
    watch.check(now=0.5)
    for node in watch.hosts:
        beat(watch.state, node, "ended")
    assert watch.check(now=500.0) == []


def test_a_node_silent_alone_or_down_in_slurm_is_lost(
    watch: node_watch.NodeWatch, monkeypatch: pytest.MonkeyPatch
) -> None:
    beat(watch.state, "cn11", "0")
    beat(watch.state, "cn12", "0")
    watch.check(now=1.0)
    beat(watch.state, "cn11", "1")
    assert watch.check(now=node_watch.SILENT_ALONE_S + 2) == ["cn12"]
    assert not watch.others_ended()  # cn11's ranks run on, blocked on their lost peer
    other = node_watch.NodeWatch(watch.state, "9", ["cn11", "cn12"])
    other.begin("M", now=0.0)  # a later step: the earlier step's beats are not its own
    assert other.check(now=100.0) == []  # no beat yet: the agents may still be starting
    states = {"cn11": "MIXED", "cn12": "DOWN+NOT_RESPONDING"}
    monkeypatch.setattr(node_watch.scontrol, "node_states", lambda nodes: states)
    assert other.check(now=101.0, ask_slurm=True) == ["cn12"]
    assert other.why == "cn12: SLURM says DOWN+NOT_RESPONDING"


def test_an_agent_beats_for_its_slot_and_says_when_it_ended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = StateDir(tmp_path / "state")
    record = slot.Slot("r", str(state.root), launcher="9:cn11:42")
    env = slot.write(record, tmp_path / "slot.json")
    for name, value in {**env, "SLURMD_NODENAME": "cn13"}.items():
        monkeypatch.setenv(name, value)
    end = node_summary.start()
    path = state.node_beats / "cn13"
    first = NodeRecord.read(path)
    assert first is not None
    assert (first.launcher, first.count, first.ended) == ("9:cn11:42", 1, False)
    end()
    last = NodeRecord.read(path)
    assert last is not None and (last.launcher, last.count, last.ended) == ("9:cn11:42", 2, True)


def test_slurm_is_asked_once_a_minute_and_at_once_when_a_node_falls_silent(
    watch: node_watch.NodeWatch,
) -> None:
    """Two nodes reporting every 5 s, checked every second (read every 2 s): scontrol at each
    whole minute, 10 times in 600 s (it was every 15 s: 40 times); then cn12 falls silent after
    600 s: asked at once when its record is 10 s late (610 s), and only once."""

    clock = [0]

    def run(until: int, nodes: list[str]) -> None:
        for t in range(clock[0], until):
            if t % 5 == 0:
                for node in nodes:
                    beat(watch.state, node, str(t // 5))
            assert watch.check(now=float(t)) == []
        clock[0] = until

    run(601, ["cn11", "cn12"])
    assert watch.slurm_calls == 10
    run(610, ["cn11"])
    assert watch.slurm_calls == 10
    run(611, ["cn11"])
    assert watch.slurm_calls == 11  # cn12 silent 10 s
    run(659, ["cn11"])
    assert watch.slurm_calls == 11


@pytest.mark.parametrize("made_by", ["this user", "nobody", "a link", "open to others"])
def test_the_node_local_beats_folder_is_this_users_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, made_by: str
) -> None:
    """The ranks beat into it and the launcher reads it: a folder of that name made first
    by another user, a link, or one open to others is refused (nothing beats)."""
    base = tmp_path / "ddppipe-0"
    monkeypatch.setattr(node_beats, "local_base", lambda: base)
    if made_by == "nobody":
        base.mkdir(mode=0o700)
        os.chown(base, pwd.getpwnam("nobody").pw_uid, -1)
    elif made_by == "a link":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        base.symlink_to(tmp_path / "elsewhere")
    elif made_by == "open to others":
        base.mkdir()
        base.chmod(0o777)
    assert node_beats.private_base() is (made_by == "this user")
    assert node_beats.make_local_folder(base / "slot-n1") is (made_by == "this user")
