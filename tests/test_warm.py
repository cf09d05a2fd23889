"""Warm ranks (ddppipe.launching.warm): one server imports torch once and forks each rank of a
local slot, with the launcher's environment, folder, CPUs and output; its exit or its signal
comes back as a child's would; a launcher that dies takes its ranks with it; and the ddppipe
subcommands that import torch or matplotlib run forked too."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddppipe.launching import warm, workers

# A rank's program (python -m probe): what it inherited, written where the test says.
PROBE = """
import json, os, sys
torch_before = "torch" in sys.modules  # imported by the server, not by this process
out = os.environ["PROBE_OUT"]
with open(os.path.join(out, os.environ.get("RANK", "x") + ".json"), "w") as f:
    json.dump({"torch_before": torch_before, "cwd": os.getcwd(), "ppid": os.getppid(),
               "cpus": sorted(os.sched_getaffinity(0)), "rank": os.environ.get("RANK"),
               "world": os.environ.get("WORLD_SIZE"), "argv": sys.argv[1:],
               "nice": os.getpriority(os.PRIO_PROCESS, 0)}, f)
print("hello from", os.environ.get("RANK"))
mode = os.environ.get("PROBE_MODE", "")
if mode == "exit":
    sys.exit(int(os.environ["RANK"]) + 3)
if mode == "kill":
    os.kill(os.getpid(), 9)
if mode == "sleep":
    import time
    time.sleep(120)
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A server on a short socket path, with the probe module importable; its environment."""
    folder = tmp_path_factory.mktemp("warm")
    (folder / "probe.py").write_text(PROBE)
    socket_path = warm.local_socket().with_name(f"ddppipe-warm-test-{os.getpid()}.sock")
    env = {**os.environ, "PYTHONPATH": f"{folder}:{os.environ.get('PYTHONPATH', '')}"}
    with open(folder / "server.log", "wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ddppipe", "warm-server", "--socket", str(socket_path)],
            env=env, stdout=subprocess.DEVNULL, stderr=sink,
        )  # fmt: skip
    served = {**env, warm.SOCKET_ENV: str(socket_path), warm.SERVER_ENV: str(proc.pid)}
    yield served
    proc.terminate()
    assert proc.wait(timeout=30) == 0
    assert not socket_path.exists()  # the server removes its socket


def probe(server: dict[str, str], out: Path, mode: str = "") -> dict[str, str]:
    return {**server, "PROBE_OUT": str(out), "PROBE_MODE": mode}


def test_a_worker_group_forks_its_ranks_from_the_server(server: dict, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    log = tmp_path / "stdout"
    with open(log, "w") as sink:
        saved = os.dup(1)
        os.dup2(sink.fileno(), 1)  # the launcher's stdout: the ranks print there
        try:
            group = workers.Group([sys.executable, "-m", "probe", "--flag"],
                                  probe(server, out), 2, 0)  # fmt: skip
            assert all(isinstance(p, warm.Rank) for p in group.procs)
            assert group.wait() == 0
        finally:
            os.dup2(saved, 1)
            os.close(saved)
    seen = [json.loads((out / f"{rank}.json").read_text()) for rank in (0, 1)]
    assert [s["torch_before"] for s in seen] == [True, True]  # warm: torch already there
    assert [s["rank"] for s in seen] == ["0", "1"] and {s["world"] for s in seen} == {"2"}
    assert {s["cwd"] for s in seen} == {os.getcwd()}
    assert {tuple(s["cpus"]) for s in seen} == {tuple(sorted(os.sched_getaffinity(0)))}
    assert {tuple(s["argv"]) for s in seen} == {("--flag",)}
    assert {s["nice"] for s in seen} == {os.getpriority(os.PRIO_PROCESS, 0)}
    assert sorted(log.read_text().splitlines()) == ["hello from 0", "hello from 1"]


def test_a_forked_command_takes_its_callers_priority(server: dict, tmp_path: Path) -> None:
    """A rule's command beside a training (`ddppipe summary`, ...) lowers its priority
    (niceness 10), then asks the server: the fork runs at that niceness, not the server's."""
    caller = (
        "import os, sys; from ddppipe.launching import warm; os.nice(7); "
        "sys.exit(warm.spawn([sys.executable, '-m', 'probe'], dict(os.environ)).wait())"
    )
    base = os.getpriority(os.PRIO_PROCESS, 0)
    subprocess.run([sys.executable, "-c", caller], env={**probe(server, tmp_path), "RANK": "0"},
                   check=True, timeout=60)  # fmt: skip
    assert json.loads((tmp_path / "0.json").read_text())["nice"] == min(base + 7, 19)


def test_the_commands_beside_a_training_run_at_a_lower_priority(monkeypatch) -> None:
    from ddppipe.cli import main

    niced: list[int] = []
    monkeypatch.setattr(os, "nice", niced.append)
    for command in ("summary", "plot-training", "export", "launch", "resolve-config"):
        with pytest.raises(SystemExit):
            main.main([command, "--help"])
    assert niced == [10, 10, 10]  # not the training, nor the next trial's config


def test_a_ranks_exit_status_and_signal_come_back(server: dict, tmp_path: Path) -> None:
    exits = workers.Group([sys.executable, "-m", "probe"], probe(server, tmp_path, "exit"), 1, 0)
    assert exits.wait() == 3  # rank 0 exits 3
    rank = warm.spawn([sys.executable, "-m", "probe"], probe(server, tmp_path, "kill"))
    assert rank is not None
    assert rank.wait(timeout=60) == -signal.SIGKILL  # as Popen says it


def test_a_rank_whose_launcher_dies_is_killed(server: dict, tmp_path: Path) -> None:
    launcher = textwrap.dedent("""
        import sys, time
        from ddppipe.launching import warm
        rank = warm.spawn([sys.executable, "-m", "probe"], dict(__import__("os").environ))
        print("pid", rank.pid, flush=True)
        time.sleep(120)
    """)  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True,
                            stderr=subprocess.PIPE,
                            env={**probe(server, tmp_path, "sleep"), "RANK": "0"})  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    line = ""
    while not line.startswith("pid "):  # (the rank prints to the same stdout)
        line = proc.stdout.readline()
        assert line, f"the launcher ended without a rank: {proc.stderr.read()[-3000:]}"
    pid = int(line.split()[1])
    assert Path(f"/proc/{pid}").exists()
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{pid}").exists()


def test_a_command_that_is_no_python_module_starts_cold(server: dict) -> None:
    assert not warm.usable([sys.executable, "-c", "pass"], server)
    assert not warm.usable(["/usr/bin/python3", "-m", "probe"], server)  # another Python
    assert not warm.usable([sys.executable, "-m", "probe"], {})  # no server
    assert warm.usable([sys.executable, "-m", "probe"], server)


def test_a_subcommand_runs_forked_and_keeps_its_exit_status(
    server: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ddppipe summary` of a folder that is no run: forked, its status as when run here."""
    missing = str(tmp_path / "none")
    cold = subprocess.run([sys.executable, "-m", "ddppipe", "summary", missing],
                          capture_output=True, text=True)  # fmt: skip
    for name in (warm.SOCKET_ENV, warm.SERVER_ENV):
        monkeypatch.setenv(name, server[name])
    assert warm.delegate(["summary", missing]) == cold.returncode == 2
    monkeypatch.setenv(warm.CHILD_ENV, "1")  # a forked command runs itself, never delegates
    assert warm.delegate(["summary", missing]) is None


def test_a_rank_imports_from_its_callers_pythonpath(server: dict, tmp_path: Path) -> None:
    """A module only on the caller's PYTHONPATH (not the server's) runs forked."""
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "only_mine.py").write_text("import sys\nsys.exit(7)\n")
    env = {**server, "PYTHONPATH": f"{tmp_path / 'mine'}:{server['PYTHONPATH']}"}
    rank = warm.spawn([sys.executable, "-m", "only_mine"], env)
    assert rank is not None and rank.wait(timeout=60) == 7
