"""Golden tests of the srun step and torchrun options, from the one SLURM request object."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddppipe.apptainer import running
from ddppipe.core import slot
from ddppipe.launching import launch, lifecycle, slot_machine, watchdog
from ddppipe.parallel import node_check
from ddppipe.runstate import attempts, failures
from ddppipe.runstate.state import StateDir
from ddppipe.settings import run_spec as run_spec
from ddppipe.slurm import request as slurm_request
from ddppipe.slurm import scontrol
from tests.tiny import default_config


def test_srun_torchrun_command() -> None:
    cfg = default_config()
    cfg["launch"].update(nnodes=2, max_restarts=3, device="gpu")
    spec = run_spec.resolve(cfg, gpus=True)
    plan = launch.plan(
        spec,
        ["train", "--config=c"],
        running.python_command(spec),
        env={"SLURM_JOB_ID": "1234"},
        hosts=["gpu-a01", "gpu-a02"],
    )
    assert plan.command == [
        "srun", "--jobid=1234", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1",
        "--cpus-per-task=2", "--kill-on-bad-exit=1", "--export=ALL", "--gres=gpu:2",
        sys.executable, "-m", "ddppipe", "agent", "--nnodes=2", "--nproc-per-node=2",
        "--rdzv-backend=c10d", "--rdzv-id=1234",
        "--rdzv-conf=join_timeout=120,keep_alive_interval=5", "--max-restarts=3", "-m", "ddppipe",
        "train", "--config=c",
    ]  # fmt: skip


def test_rendezvous_host_override() -> None:
    cfg = default_config()
    cfg["slurm"]["rendezvous_host"] = "ib-node1"
    args = slurm_request.Request.from_spec(run_spec.resolve(cfg, gpus=False)).torchrun_args("7")
    assert "--rdzv-endpoint=ib-node1:15007" in args


def test_rendezvous_from_the_steps_nodes() -> None:
    """A step on a subset of its job's nodes meets on its own first node, not the job's."""
    env = {
        "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "gpu-a[01-04]",
        "SLURM_STEP_NODELIST": "gpu-a[03-04]",
    }  # fmt: skip
    assert slurm_request.step_rendezvous(env) == "gpu-a03:15007"
    assert slurm_request.step_rendezvous({**env, "SLURM_STEP_NODELIST": ""}) == "gpu-a01:15007"
    # two steps at once on one first node (a packed allocation's trials): each its own port
    assert slurm_request.step_rendezvous({**env, "SLURM_STEP_ID": "3"}) == "gpu-a03:18034"
    assert slurm_request.step_rendezvous({**env, "SLURM_STEP_ID": "4"}) == "gpu-a03:19043"


def test_scontrol_records_and_hostlists() -> None:
    line = "JobId=7 JobName=x JobState=RUNNING Reason=None NodeList=cn[07-08] TRES=cpu=2,mem=1G"
    record = scontrol.parse_record(line)
    assert record["JobState"] == "RUNNING" and record["TRES"] == "cpu=2,mem=1G"
    assert scontrol.parse_nodelist(line) == ["cn07", "cn08"]


NODE_LINES = [  # ``scontrol -o show node`` lines: the node and its state as ddppipe reads it
    ("NodeName=cn07 Arch=x86_64 State=MIXED+DRAIN Weight=1 Reason=Kill task failed "
     "[root@2026-12-07T11:00:00] Comment=(null)", ("cn07", "MIXED+DRAIN+KILL_TASK_FAILED")),
    ("NodeName=gpu-a12 State=DRAIN Reason=Kill task failed [slurm@2026-12-07T11:00:00]",
     ("gpu-a12", "DRAIN+KILL_TASK_FAILED")),
    ("NodeName=cn08 State=MIXED+DRAIN Reason=maintenance [root@2026-12-07T11:00:00]",
     ("cn08", "MIXED+DRAIN")),  # an administrator's drain
    ("NodeName=cn09 State=MIXED+DRAIN Reason=after Kill task failed on cn07 [root@2026-12-07T1]",
     ("cn09", "MIXED+DRAIN")),  # (only a Reason that starts with slurmd's words)
    ("NodeName=cn10 State=IDLE Weight=1", ("cn10", "IDLE")),
    ("   ", None),
]  # fmt: skip


@pytest.mark.parametrize(("line", "state"), NODE_LINES)
def test_a_node_drained_by_slurmd_for_a_task_it_could_not_kill_is_failed(line, state) -> None:
    assert scontrol.parse_node_state(line) == state
    if state is not None:
        failed = "KILL_TASK_FAILED" in state[1]
        assert scontrol.failed_nodes(dict([state])) == ([state[0]] if failed else [])


def _step(tmp_path: Path, marks: str, then: str = "") -> launch.Ended:
    """supervise() an "srun step" on cn07 and cn08 that exits 0 after the agents' marks
    ``marks`` (a space-separated list of node names) were written (and runs ``then``)."""
    cfg = default_config()
    cfg["launch"]["nnodes"] = 2
    marker = (
        "import os, sys; from ddppipe.runstate import finished_nodes\n"
        "for node in sys.argv[1].split():\n"
        "    os.environ['SLURMD_NODENAME'] = node; finished_nodes.mark()\n"
        f"{then}\n"
    )
    plan = launch.Plan(
        [sys.executable, "-c", marker, marks], dict(os.environ), "7", ["cn07", "cn08"],
        slurm_request.Request.from_spec(run_spec.resolve(cfg, gpus=False)),
    )  # fmt: skip
    record = slot.Slot("two-nodes", str((tmp_path / "state").resolve()))
    return launch.supervise(plan, plan.env, record)


def test_srun_exit_0_is_a_finished_step_only_with_every_nodes_mark(tmp_path: Path) -> None:
    """srun exits 0 on "Node failure on cn08": without cn08's mark, the step did not finish."""
    assert _step(tmp_path, "cn07 cn08") == launch.Ended(0, None, [])
    ended = _step(tmp_path, "cn07")  # (the first step's marks are cleared)
    note = ended.note
    assert ended.code == 0 and note is not None and note["checkpoint"] is None, note
    assert sorted(p.name for p in (tmp_path / "state/finished-nodes").iterdir()) == ["cn07"]


def test_the_nodes_failed_checks_are_read_from_the_steps_stderr(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """cn08's agent says its node's problem on stderr and exits 3, which ends the step: the
    launcher keeps that line (and passes every line on to its own stderr, the slot's log)."""
    said = "preflight: cn08: does not see the run's state folder as the job's first node does"
    ended = _step(tmp_path, "", f"print('srun: a line of its own', file=sys.stderr)\n"
                                f"print({said!r}, file=sys.stderr); sys.exit(3)")  # fmt: skip
    assert (ended.code, ended.checks) == (3, [said])
    assert node_check.failing_nodes("\n".join(ended.checks), ["cn07", "cn08"]) == ["cn08"]
    assert capfd.readouterr().err.splitlines() == ["srun: a line of its own", said]


def test_a_missing_mark_ends_the_slot_only_when_slurm_ends_the_job() -> None:
    up = {"cn07": "MIXED", "cn08": "MIXED+DRAIN"}  # draining waits for the job: no failure
    running, requeued = {"JobState": "RUNNING"}, {"JobState": "PENDING", "Reason": "BeginTime"}
    assert not scontrol.ending(running, up)  # a late mark: srun's exit 0 stands
    assert scontrol.ending(running, {**up, "cn08": "DOWN+DRAIN"})
    assert scontrol.ending(running, {**up, "cn08": "IDLE+NOT_RESPONDING"})
    assert scontrol.ending(requeued, up)


END = "2026-12-07T12:00:00"  # the job's time limit (scontrol's local time)
RUNNING = {"JobState": "RUNNING", "EndTime": END}
UP = {"cn07": "MIXED", "cn08": "MIXED"}
UNKNOWN = "stopped on SIGUSR1 (cause unknown: scontrol show job failed)"


@pytest.mark.parametrize(
    ("nodes", "job", "signal_name", "outcome"),
    [
        # drained for maintenance, still running the job: the time limit stands
        ({**UP, "cn08": "MIXED+DRAIN"}, RUNNING, "SIGUSR1", "time limit"),
        ({**UP, "cn08": "ALLOCATED+DRAIN"}, RUNNING, "SIGUSR1", "time limit"),
        ({**UP, "cn08": "DRAINING"}, RUNNING, "SIGUSR1", "time limit"),  # (sinfo's word)
        ({**UP, "cn08": "MIXED+FAIL"}, RUNNING, "SIGUSR1", "time limit"),  # expected to fail
        ({**UP, "cn08": "ALLOCATED+POWER_DOWN"}, RUNNING, "SIGUSR1", "time limit"),  # after it
        # gone: down, not responding, powered down
        ({**UP, "cn08": "DOWN+DRAIN"}, RUNNING, "SIGUSR1", "node failure"),
        ({**UP, "cn08": "DOWN+DRAIN+NOT_RESPONDING"}, RUNNING, "SIGUSR1", "node failure"),
        ({**UP, "cn08": "MIXED+NOT_RESPONDING"}, RUNNING, "SIGUSR1", "node failure"),
        ({**UP, "cn08": "IDLE+POWERED_DOWN"}, RUNNING, "SIGUSR1", "node failure"),
        ({**UP, "cn08": "DOWN+DRAIN"}, {}, "SIGUSR1", "node failure"),
        # the job query failed ({}): unknown, not a user's signal; the node query ({}) too
        (UP, {}, "SIGUSR1", UNKNOWN),
        ({}, RUNNING, "SIGUSR1", "time limit"),
        (UP, None, "SIGUSR1", "stopped on SIGUSR1"),  # outside SLURM
        (UP, {"JobState": "RUNNING", "EndTime": "2026-12-07T13:00:00"}, "SIGUSR1",
         "stopped on SIGUSR1"),  # an hour left: scancel --signal
        (UP, {"JobState": "PREEMPTED", "EndTime": END}, "SIGTERM", "preempted"),
        (UP, {"JobState": "PENDING", "EndTime": END}, "SIGTERM", "requeued by SLURM"),
    ],
)  # fmt: skip
def test_how_a_slot_stopped_on_a_signal_ended(
    nodes: dict[str, str], job: dict[str, str] | None, signal_name: str, outcome: str
) -> None:
    """(its nodes' states, its job's record, the signal) -> outcome; 80 s before the time
    limit with a 60 s warning (and 30 s of slack) is a time limit's warning."""
    now = scontrol.timestamp(END) - 80
    assert slot_machine.classify(signal_name, job, nodes, 60, now=now) == outcome


def test_srun_in_the_image_binds_the_squashfs_image_over_the_tasks_folder(
    tmp_path: Path,
) -> None:
    """container.mode apptainer, data.pack squashfs: every node's step runs the image with the
    data folder's SquashFS image bound over task_args.root (the manifest names the image); a
    folder with a comma in its path through --mount."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "manifest.json").write_text(
        '{"files": {}, "digest": "0", "squashfs": {"image": "root-0123456789abcdef.sqfs",'
        ' "arg": "root"}}'
    )
    cfg = default_config()
    cfg.update(task="ddppipe.tasks.imagefolder", task_args={"root": "/project/images"})
    cfg["data"] = {"pack": "squashfs"}
    cfg["container"].update(mode="apptainer", image="/images/ddppipe.sif")
    cfg["launch"].update(nnodes=2, nproc_per_node=1)
    spec = run_spec.resolve(cfg, gpus=False)
    plan = launch.plan(spec, ["train", "--config=c"], running.python_command(spec, data),
                       env={"SLURM_JOB_ID": "77"}, hosts=["cn07", "cn08"])  # fmt: skip
    image = data / "root-0123456789abcdef.sqfs"
    step = plan.command[: plan.command.index("agent") + 1]
    assert step[-9:] == [
        "apptainer", "exec", "--bind", f"{image}:/project/images:image-src=/",
        "/images/ddppipe.sif", "python", "-m", "ddppipe", "agent",
    ]  # fmt: skip
    assert step[:2] == ["srun", "--jobid=77"] and "--nodes=2" in step
    # a task folder whose path has a comma: a quoted --mount (--bind would split it)
    cfg["task_args"] = {"root": "/project/a,b"}
    spec = run_spec.resolve(cfg, gpus=False)
    plan = launch.plan(spec, ["train", "--config=c"], running.python_command(spec, data),
                       env={"SLURM_JOB_ID": "77"}, hosts=["cn07", "cn08"])  # fmt: skip
    assert plan.command[plan.command.index("exec") + 1 : plan.command.index("exec") + 3] == [
        "--mount", f'type=bind,src={image},"dst=/project/a,b",image-src=/'
    ]  # fmt: skip


def _spare_plan(
    hosts: list[str], exclude: tuple[str, ...] = (), nnodes: int = 2, batch: str = "",
    **slurm: object,
) -> launch.Plan:  # fmt: skip
    cfg = default_config()
    cfg["launch"].update(nnodes=nnodes, nproc_per_node=1)
    cfg["slurm"].update(slurm)
    spec = run_spec.resolve(cfg, gpus=False)
    env = {"SLURM_JOB_ID": "9", **({"SLURMD_NODENAME": batch} if batch else {})}
    return launch.plan(spec, ["train"], ["python"], env=env, hosts=hosts, exclude=exclude)


def test_a_job_with_a_spare_asks_for_it_and_its_steps_run_on_chosen_nodes() -> None:
    """slurm.spare_nodes: the job holds a node more, submitted with --no-kill; each step asks
    for --no-kill itself (sbatch's does not reach it), on its nodes, sharing their CPUs with a
    lost node's step that SLURM still counts; a lost node's place taken by the spare. The
    spare is the job's first node, where the launcher runs (its loss ends the job anyway),
    while another is left."""
    cfg = default_config()
    cfg["launch"].update(nnodes=2, nproc_per_node=1)
    cfg["slurm"]["spare_nodes"] = 1
    resources = slurm_request.Request.from_spec(run_spec.resolve(cfg, gpus=False)).resources()
    assert (resources["nodes"], resources["tasks"]) == (3, 3)
    assert resources["slurm_extra"] == "--ntasks-per-node=1 --no-kill"
    first = _spare_plan(["cn11", "cn12", "cn13"], spare_nodes=1)
    assert first.hosts == ["cn12", "cn13"]
    assert first.command[:11] == [
        "srun", "--jobid=9", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1",
        "--cpus-per-task=1", "--kill-on-bad-exit=1", "--export=ALL", "--no-kill",
        "--nodelist=cn12,cn13", "--overlap",
    ]  # fmt: skip
    after = _spare_plan(["cn11", "cn12", "cn13"], ("cn12",), spare_nodes=1)
    assert after.hosts == ["cn11", "cn13"] and "--nodelist=cn11,cn13" in after.command
    assert "--nnodes=2" in after.command
    one = _spare_plan(["cn11", "cn12"], nnodes=1, spare_nodes=1)  # one node and its spare
    assert one.hosts == ["cn12"] and "--nodelist=cn12" in one.command
    assert _spare_plan(["cn11", "cn12"], ("cn12",), nnodes=1, spare_nodes=1).hosts == ["cn11"]
    batch = _spare_plan(["cn11", "cn12", "cn13"], spare_nodes=1, batch="cn12")
    assert batch.hosts == ["cn11", "cn13"]  # the launcher's own node (SLURMD_NODENAME) spare
    fixed = _spare_plan(["cn11", "cn12", "cn13"], spare_nodes=1, rendezvous_host="cn11")
    assert fixed.hosts == ["cn11", "cn12"]  # the rendezvous named on the first node: it trains


def test_min_nodes_goes_on_at_fewer_nodes_and_no_further() -> None:
    """slurm.min_nodes without a spare: a step of the nodes left (torchrun's too), down to
    min_nodes; fewer is an error naming the nodes; more than launch.nnodes is refused."""
    shrunk = _spare_plan(["cn11", "cn12"], ("cn12",), min_nodes=1)
    assert shrunk.hosts == ["cn11"] and shrunk.request.world_size == 1
    assert {"--nodes=1", "--nodelist=cn11", "--no-kill", "--nnodes=1"} <= set(shrunk.command)
    assert "--no-kill" in shrunk.request.resources()["slurm_extra"]
    assert shrunk.request.resources()["nodes"] == 2  # the next slot asks for launch.nnodes
    try:
        _spare_plan(["cn11", "cn12"], ("cn11", "cn12"), min_nodes=1)
    except slurm_request.SlurmRequestError as e:
        assert "0 healthy node(s) left in the job (none; bad: cn11, cn12)" in str(e)
    else:
        raise AssertionError("a step on no node was planned")
    try:
        _spare_plan(["cn11", "cn12"], min_nodes=3)
    except slurm_request.SlurmRequestError as e:
        assert "slurm.min_nodes (3) is more than launch.nnodes (2)" in str(e)
    else:
        raise AssertionError("min_nodes above nnodes was accepted")
    plain = _spare_plan(["cn11", "cn12", "cn13"])  # neither: the job's nodes, as before
    assert "--no-kill" not in plain.command and plain.hosts == ["cn11", "cn12", "cn13"]


def _lost_then(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nodes: list[str], then: launch.Ended,
    job_nodes: tuple[str, ...] = ("cn11", "cn12", "cn13"), **slurm: object,
) -> tuple[int, StateDir]:  # fmt: skip
    """lifecycle.run of a 2-node run in job 9 on ``job_nodes`` whose first step loses cn12,
    the next step (on ``nodes``, the job's nodes then) ending as ``then``: its exit, its state
    (and beside it ``watched.json``: the ranks each slot's hang watchdog waited for)."""
    cfg = default_config()
    cfg["launch"].update(nnodes=2, nproc_per_node=1)
    cfg["slurm"].update(slurm)
    monkeypatch.setenv("SLURM_JOB_ID", "9")
    monkeypatch.delenv("SLURMD_NODENAME", raising=False)  # (the launcher's node: cn11, first)
    job = {"JobState": "RUNNING", "Restarts": "0", "SubmitTime": "2026-11-29T01:00:00",
           "EligibleTime": "2026-11-29T01:00:00", "StartTime": "2026-11-29T01:10:00"}  # fmt: skip
    listed = iter([list(job_nodes), nodes])
    monkeypatch.setattr(scontrol, "job_record", lambda job_id: job)
    monkeypatch.setattr(scontrol, "job_nodes", lambda job_id: next(listed))
    monkeypatch.setattr(scontrol, "node_states", lambda hosts: dict.fromkeys(hosts, "MIXED"))
    lost = launch.Ended(137, {"signal": None, "checkpoint": None, "lost": ["cn12"],
                              "detail": "cn12: its agent silent 10 s"})  # fmt: skip
    ended = iter([lost, then])
    watched: list[list[int]] = []

    def supervise(plan: launch.Plan, env: dict, opened: slot.Slot, warn_in: float | None,
                  watch: watchdog.Watchdog) -> launch.Ended:  # fmt: skip
        watched.append(sorted(watch.views))  # the ranks its hang watchdog waits for
        return next(ended)

    monkeypatch.setattr(launch, "supervise", supervise)
    state = StateDir(tmp_path / "state")
    code = lifecycle.run(run_spec.resolve(cfg, gpus=False), ["python"], ["-m", "ddppipe", "train"],
                         state, None)  # fmt: skip
    (state.root / "watched.json").write_text(json.dumps(watched))
    return code, state


def test_a_slot_continued_in_its_job_after_a_lost_node_starts_then_and_did_not_queue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job queued 10 minutes once: its first slot says so, the slot continued in it after
    cn12 was lost (on the spare) starts when it starts and queued 0 s (the summary adds the
    slots' waits)."""
    before = time.time()
    code, state = _lost_then(tmp_path, monkeypatch, ["cn11", "cn12", "cn13"],
                             launch.Ended(0, None), spare_nodes=1)  # fmt: skip
    assert code == 0
    first, second = attempts.load(state)
    assert (first.outcome, second.outcome) == ("node failure", "completed")
    assert (first.nodes, second.nodes) == (["cn12", "cn13"], ["cn11", "cn13"])
    assert (first.job, first.restarts) == (second.job, second.restarts) == ("9", 0)
    assert (first.queue_s, second.queue_s) == (600.0, 0.0)
    assert second.start >= before


def test_too_few_nodes_left_requeue_the_job_or_say_that_it_could_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """cn12 lost and no spare in the job any more (SLURM shrank it to cn11, cn12): the
    launcher requeues the job; when scontrol refuses, the log says so and what follows."""
    requeued: list[str] = []
    monkeypatch.setattr(scontrol, "requeue", requeued.append)
    code, _ = _lost_then(tmp_path / "a", monkeypatch, ["cn11", "cn12"], launch.Ended(0, None),
                         spare_nodes=1)  # fmt: skip
    assert (code, requeued) == (75, ["9"])

    def refuse(job: str) -> None:
        raise subprocess.CalledProcessError(1, ["scontrol"], stderr="Requeue of job is disabled")

    monkeypatch.setattr(scontrol, "requeue", refuse)
    caplog.clear()
    code, _ = _lost_then(tmp_path / "b", monkeypatch, ["cn11", "cn12"], launch.Ended(0, None),
                         spare_nodes=1)  # fmt: skip
    assert code == 75
    said = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert (
        "could not requeue job 9 (Requeue of job is disabled); exiting 75: Snakemake retries "
        "the job, which uses one of its --retries"
    ) in said, said


def test_a_slot_continued_at_fewer_nodes_watches_the_ranks_it_has(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """min_nodes 1: cn12 lost, the next slot trains on cn11 alone (world size 1); its hang
    watchdog waits for rank 0 only (a rank 1 that never comes would be named hung once the
    start-up's allowance had passed, and the slot killed)."""
    code, state = _lost_then(tmp_path, monkeypatch, ["cn11", "cn12"], launch.Ended(0, None),
                             ("cn11", "cn12"), min_nodes=1)  # fmt: skip
    assert code == 0
    first, second = attempts.load(state)
    assert (first.nodes, second.nodes) == (["cn11", "cn12"], ["cn11"])
    assert json.loads((state.root / "watched.json").read_text()) == [[0, 1], [0]]


def test_a_slot_continued_after_a_lost_node_too_late_to_train_requeues_its_job() -> None:
    """A node lost in the last minutes of the job's time: the slot that goes on in the job
    gets the time-limit warning before it checkpoints a step. Its job requeues (a fresh time
    limit), as the run's first slot of a job that checkpointed nothing would not."""
    lost = attempts.Attempt(1, "9", 0, ["cn12", "cn13"], 0.0, outcome="node failure",
                            start_step=0, end_step=150)  # fmt: skip
    late = attempts.Attempt(2, "9", 0, ["cn11", "cn13"], 0.0, outcome="time limit",
                            start_step=150, end_step=150)  # fmt: skip
    assert slot_machine.decide([lost, late], max_continuations=5).requeue
    alone = slot_machine.decide([late], max_continuations=5)  # (its job's first slot)
    assert not alone.requeue and alone.reason.startswith("no progress: slot 2 (job 9)")
    requeued = attempts.Attempt(2, "9", 1, ["cn11", "cn13"], 0.0, outcome="time limit",
                                start_step=150, end_step=150)  # fmt: skip
    assert not slot_machine.decide([lost, requeued], max_continuations=5).requeue


def test_a_rendezvous_timeout_is_its_own_outcome_and_says_what_to_check(
    tmp_path: Path,
) -> None:
    """A node's agent whose step's other node never joins (a 2-node rendezvous, one agent,
    join_timeout 1 s): torch's RendezvousTimeoutError is recorded as the slot's failure, its
    outcome `rendezvous timeout` (not `crashed (exit 1)`), its cause what to check; the same
    twice in a row does not end the run (other nodes may meet). The agent removes torchrun's
    folder of its workers' error files as it ends (torchrun makes one in $TMPDIR for every
    step and leaves it)."""
    state = StateDir(tmp_path / "state")
    env = slot.write(slot.Slot("r", str(state.root), launcher="41:cn07:1/1"), tmp_path / "s.json")
    with socket.socket() as probe:  # a free port of this host for the rendezvous store
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    agent = [sys.executable, "-m", "ddppipe", "agent", "--nnodes=2", "--nproc-per-node=1",
             "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=41",
             "--rdzv-conf=join_timeout=1", "-m", "this.never.runs"]  # fmt: skip
    tmp = tmp_path / "node-tmp"
    tmp.mkdir()
    ended = subprocess.run(agent, env={**os.environ, **env, "TMPDIR": str(tmp)},
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert ended.returncode == 1, ended.stderr[-3000:]
    assert os.listdir(tmp) == []
    found = failures.first(state.failures)
    assert found is not None and found.rendezvous
    assert found.outcome() == "rendezvous timeout"
    host = socket.gethostname()
    said = (
        f"{host}: the step's nodes did not all join the rendezvous at 127.0.0.1:{port} within "
        "1 s (its join_timeout): a node's agent did not start, or cannot reach it. Check the "
        "slot's log for another node's error before it, that every node reaches "
        f"127.0.0.1:{port} (a firewall between nodes"
    )
    assert found.cause().startswith(said)
    assert f"ddppipe agent: {said}" in ended.stderr
    cfg = default_config()
    spec = run_spec.resolve(cfg, gpus=False)
    for _ in range(2):  # the same rendezvous timeout in two slots in a row
        attempts.begin(state, "41", 0, ["cn07", "cn08"])
        local = slot_machine.SlotState(None, False, ())  # (a local slot's)
        assert lifecycle._end(spec, local, state, launch.Ended(1, None)) == 1
    assert [a.outcome for a in attempts.load(state)] == ["rendezvous timeout"] * 2
    assert failures.refusal(state, failures.identity(spec)) is None  # retried
