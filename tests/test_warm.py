"""Warm ranks (ddppipe.launching.warm): one server imports torch once and forks each rank of a
local slot, with the launcher's environment, folder, CPUs and output; its exit or its signal
comes back as a child's would; a launcher that dies takes its ranks with it; the ddppipe
subcommands that import torch or matplotlib run forked too; and no one but its user, asking
for anything but a rank or a subcommand, gets anything forked (the server runs under umask 000
here, as a user sharing a project folder with everyone might)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddppipe.cli import main
from ddppipe.core import env_names
from ddppipe.launching import warm, warm_client, warm_reaper, workers

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


LOG_ENV = "WARM_TEST_LOG"  # (the test's) where the server logs


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A server started under umask 000, the probe script beside its log; its environment."""
    folder = tmp_path_factory.mktemp("warm")
    (folder / "probe.py").write_text(PROBE)
    env = {**os.environ, "PROBE": str(folder / "probe.py"), LOG_ENV: str(folder / "server.log")}
    umask = os.umask(0)
    try:
        socket_path = warm.local_socket(f"ddppipe-warm-test-{os.getpid()}.sock")
        with open(folder / "server.log", "wb") as sink:
            proc = subprocess.Popen(
                [sys.executable, "-m", "ddppipe", "warm-server", "--socket", str(socket_path)],
                env=env, stdout=subprocess.DEVNULL, stderr=sink,
            )  # fmt: skip
    finally:
        os.umask(umask)
    served = {**env, env_names.WARM_SOCKET: str(socket_path), env_names.WARM_SERVER: str(proc.pid)}
    yield served
    proc.terminate()
    assert proc.wait(timeout=30) == 0
    assert not socket_path.parent.exists()  # the server removes its socket and its folder


def probe_command(server: dict[str, str], *args: str) -> list[str]:
    """A rank running the probe script, as a script run's launcher starts it."""
    return [sys.executable, "-m", "ddppipe.training.script.run_script", server["PROBE"], *args]


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
            group = workers.Group(probe_command(server, "--flag"), probe(server, out), 2, 0)
            assert all(isinstance(p, warm_client.Rank) for p in group.procs)
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
        "import os, sys; from ddppipe.launching import warm_client; os.nice(7); "
        "sys.exit(warm_client.spawn("
        "[sys.executable, '-m', 'ddppipe.training.script.run_script', os.environ['PROBE']], "
        "dict(os.environ)).wait())"
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
    exits = workers.Group(probe_command(server), probe(server, tmp_path, "exit"), 1, 0)
    assert exits.wait() == 3  # rank 0 exits 3
    rank = warm_client.spawn(probe_command(server), probe(server, tmp_path, "kill"))
    assert rank is not None
    assert rank.wait(timeout=60) == -signal.SIGKILL  # as Popen says it


def test_a_rank_whose_launcher_dies_is_killed(server: dict, tmp_path: Path) -> None:
    launcher = textwrap.dedent("""
        import sys, time
        from ddppipe.launching import warm_client
        rank = warm_client.spawn([sys.executable, "-m", "ddppipe.training.script.run_script",
                           __import__("os").environ["PROBE"]], dict(__import__("os").environ))
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


def test_a_command_that_is_no_rank_entry_point_starts_cold(server: dict) -> None:
    assert not warm_client.usable([sys.executable, "-c", "pass"], server)
    another_python = ["/usr/bin/python3", *probe_command(server)[1:]]
    assert not warm_client.usable(another_python, server)  # another interpreter
    assert not warm_client.usable(probe_command(server), {})  # no server
    assert not warm_client.usable([sys.executable, "-m", "probe"], server)  # not a rank's module
    assert warm_client.usable(probe_command(server), server)
    assert warm_client.usable([sys.executable, "-m", "ddppipe", "summary", "x"], server)


def test_a_light_command_never_waits_for_a_starting_server(tmp_path: Path) -> None:
    """A server still importing (alive, not listening yet): a command that imports no torch
    runs here at once (cli.main.LIGHT); one that does waits for it (up to READY_TIMEOUT_S)."""
    starting = {env_names.WARM_SOCKET: str(tmp_path / "not-yet.sock"),
                env_names.WARM_SERVER: str(os.getpid())}  # fmt: skip
    command = [sys.executable, "-m", "ddppipe", "summary", "x"]
    began = time.monotonic()
    assert not warm_client.usable(command, starting, wait=False)
    assert time.monotonic() - began < 0.5
    assert {"summary", "export", "data-settings", "prepare", "sweep-round"} <= main.LIGHT
    assert not {"resolve-config", "plot-evaluation", "plot-training"} & main.LIGHT


def test_a_subcommand_runs_forked_and_keeps_its_exit_status(
    server: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ddppipe summary` of a folder that is no run: forked, its status as when run here."""
    missing = str(tmp_path / "none")
    cold = subprocess.run([sys.executable, "-m", "ddppipe", "summary", missing],
                          capture_output=True, text=True)  # fmt: skip
    for name in (env_names.WARM_SOCKET, env_names.WARM_SERVER):
        monkeypatch.setenv(name, server[name])
    assert warm_client.delegate(["summary", missing]) == cold.returncode == 2
    monkeypatch.setenv(env_names.WARM_CHILD, "1")  # a forked command runs itself, never delegates
    assert warm_client.delegate(["summary", missing]) is None


def test_a_rank_imports_from_its_callers_pythonpath(server: dict, tmp_path: Path) -> None:
    """A module only on the caller's PYTHONPATH (not the server's) imports in a forked rank."""
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "only_mine.py").write_text("import sys\nsys.exit(7)\n")
    (tmp_path / "script.py").write_text("import only_mine\n")
    paths = [str(tmp_path / "mine"), server.get("PYTHONPATH", "")]
    env = {**server, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    rank = warm_client.spawn([sys.executable, "-m", "ddppipe.training.script.run_script",
                       str(tmp_path / "script.py")], env)  # fmt: skip
    assert rank is not None and rank.wait(timeout=60) == 7


# -- who may use it ----------------------------------------------------------------------------

# Another user's client (run as `nobody`, by the system's Python): asks the server to run a
# script of a served module that would write a file as the server's user.
INTRUDER = """
import json, socket, sys
path, script = sys.argv[1], sys.argv[2]
conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    conn.connect(path)
except PermissionError:
    print("denied")
    sys.exit(0)
request = {"module": "ddppipe.training.script.run_script", "args": [script], "env": {}, "cwd": "/"}
try:
    socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
    print(conn.recv(4096).decode().strip() or "closed")
except OSError:  # (closed while it wrote)
    print("closed")
"""
NOBODY = 65534


def as_nobody(server: dict[str, str], script: Path) -> str:
    """What the intruder's client, run as the user nobody, printed."""
    done = subprocess.run(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
         "/usr/bin/python3", "-c", INTRUDER, server[env_names.WARM_SOCKET], str(script)],
        cwd="/", capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return done.stdout.strip()


def test_only_the_servers_user_gets_a_rank_forked(server: dict, tmp_path: Path) -> None:
    """Started under umask 000, the socket is 0600 in a 0700 folder: the user nobody cannot
    connect. With both opened to everyone (a misconfiguration), nobody connects but its
    peer uid is refused before a byte is read: nothing forked, the refusal logged."""
    if os.getuid() == NOBODY:
        pytest.fail("this test runs as another user than nobody (root in CI)")
    assert warm_client.usable(probe_command(server), server)  # listening
    path = Path(server[env_names.WARM_SOCKET])
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    written = tmp_path / "written-by-the-server"
    script = tmp_path / "evil.py"
    script.write_text(f"open({str(written)!r}, 'w').write('run as the server user')\n")
    tmp_path.chmod(0o755)
    assert as_nobody(server, script) == "denied"
    path.parent.chmod(0o711)
    path.chmod(0o777)
    try:
        assert as_nobody(server, script) == "closed"  # no answer, no pid
    finally:
        path.parent.chmod(0o700)
        path.chmod(0o600)
    time.sleep(0.5)  # (a forked rank would have written by now)
    assert not written.exists()
    log = Path(server[LOG_ENV]).read_text()
    assert f"refused a connection of uid {NOBODY} (pid " in log
    assert f"it serves uid {os.getuid()} only" in log
    env = {**probe(server, tmp_path, "exit"), "RANK": "0"}
    rank = warm_client.spawn(probe_command(server), env)
    assert rank is not None and rank.wait(timeout=60) == 3


def test_a_request_for_another_module_is_refused(server: dict, tmp_path: Path) -> None:
    """The server's own user asks for `python -m zipfile` (not a rank's entry point): refused
    with the reason, nothing forked, the refusal logged."""
    archive = tmp_path / "hostname.zip"
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    assert warm_client.usable(probe_command(server), server)
    conn.connect(server[env_names.WARM_SOCKET])
    request = {"module": "zipfile", "args": ["-c", str(archive), "/etc/hostname"],
               "env": {}, "cwd": str(tmp_path)}  # fmt: skip
    socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
    answer = json.loads(conn.makefile().readline())
    conn.close()
    served = "ddppipe, ddppipe.training.script.run_script"
    assert answer == {"refused": f"module 'zipfile' is none of {served}"}
    assert not archive.exists()
    log = Path(server[LOG_ENV]).read_text()
    assert f"refused a request of pid {os.getpid()}: module 'zipfile'" in log
    with pytest.raises(ValueError, match="the warm server refused the rank: module 'probe'"):
        warm_client.Rank([sys.executable, "-m", "probe"], dict(server))


def test_a_socket_folder_others_may_enter_is_refused(tmp_path: Path) -> None:
    """A server given a socket in a folder other users may enter refuses to start, saying so."""
    folder = tmp_path / "shared"
    folder.mkdir(mode=0o777)
    folder.chmod(0o777)
    done = subprocess.run(
        [sys.executable, "-m", "ddppipe", "warm-server", "--socket", str(folder / "w.sock")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0
    assert (
        f"the warm server's socket folder is not private ({folder} (drwxrwxrwx, this "
        f"user's) is open to other users: chmod 700 {folder})"
    ) in done.stderr
    assert not (folder / "w.sock").exists()


# -- a server whose kept datasets touched CUDA ------------------------------------------------

# MNIST whose datasets() asks the CUDA driver (pinned memory, torch.cuda.is_available() do):
# here a stand-in library of the driver's name, mapped as the driver's would be.
CUDA_TASK = '''
"""MNIST, its datasets loaded after a call into the CUDA driver."""
import ctypes
import os

from ddppipe.tasks.mnist import ARGS_SCHEMA, datasets as mnist_datasets, model, prepare  # noqa


def datasets(data_dir, args):
    ctypes.CDLL(os.environ["STAND_IN_DRIVER"])
    return mnist_datasets(data_dir, args)
'''


def test_a_server_whose_kept_datasets_touched_cuda_forks_no_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The server checks for CUDA after each dataset it keeps (torch.cuda.is_initialized()
    says nothing of a driver asked directly): from then on each rank starts cold, and the
    launcher's log says why."""
    from tests.tiny import make_tiny

    tiny = make_tiny(tmp_path / "tiny", n_train=64, n_test=32)
    driver = tmp_path / "driver" / "libcuda.so.1"
    driver.parent.mkdir()
    shutil.copy("/lib/x86_64-linux-gnu/libm.so.6", driver)
    (tmp_path / "cuda_task.py").write_text(CUDA_TASK)
    (tmp_path / "probe.py").write_text(PROBE)
    monkeypatch.setenv("STAND_IN_DRIVER", str(driver))
    path = warm.local_socket(f"ddppipe-warm-cuda-{os.getpid()}.sock")
    data = [{"task": str(tmp_path / "cuda_task.py"), "data_dir": str(tiny.data_dir), "args": {}}]
    server = warm.start(path, tmp_path / "server.log", data)
    try:
        log = tmp_path / "server.log"
        deadline = time.monotonic() + 120
        while "every rank starts cold" not in log.read_text():
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        env = {**os.environ, env_names.WARM_SOCKET: str(path),
               env_names.WARM_SERVER: str(server.pid),
               "PROBE_OUT": str(tmp_path), "RANK": "0"}  # fmt: skip
        command = [
            sys.executable,
            "-m",
            "ddppipe.training.script.run_script",
            str(tmp_path / "probe.py"),
        ]
        with caplog.at_level(logging.WARNING, logger="ddppipe.launching.warm_client"):
            assert warm_client.spawn(command, env) is None  # started cold by its launcher
        assert "the warm server refused the rank: loading the datasets of " in caplog.text
        assert "cuda_task.py touched CUDA" in caplog.text and "the rank starts cold" in caplog.text
    finally:
        server.terminate()
        server.wait(timeout=30)


AHEAD_SERVER = """
import sys
from pathlib import Path
from ddppipe.launching import warm

def ahead():  # the rest of a rank's imports, after the server listens
    import wave
    return (wave,)

warm.serve(Path(sys.argv[1]), lambda: (), ahead=ahead)
"""

WAVE_PROBE = """
import os, sys
open(os.environ["PROBE_OUT"], "w").write(str("wave" in sys.modules))
"""


def test_a_rank_is_forked_after_the_imports_the_server_made_after_listening(
    tmp_path: Path,
) -> None:
    """The server listens once torch is in (a run's config check needs no more) and imports the
    rest of a rank's imports after: a rank has them."""
    path = warm.local_socket(f"ddppipe-warm-ahead-{os.getpid()}.sock")
    proc = subprocess.Popen([sys.executable, "-c", AHEAD_SERVER, str(path)])
    try:
        env = {**os.environ, env_names.WARM_SOCKET: str(path), "PROBE_OUT": str(tmp_path / "out"),
               env_names.WARM_SERVER: str(proc.pid)}  # fmt: skip
        (tmp_path / "probe.py").write_text(WAVE_PROBE)
        command = [sys.executable, "-m", "ddppipe.training.script.run_script",
                   str(tmp_path / "probe.py")]  # fmt: skip
        rank = warm_client.spawn(command, env)
        assert rank is not None and rank.wait(timeout=60) == 0
        assert (tmp_path / "out").read_text() == "True"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_ranks_end_is_told_while_the_server_imports() -> None:
    """While the server imports (seconds without its loop), a rank that ends has its exit told
    to its launcher at once: a run's config check waits for it."""
    server_end, launcher_end = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        os._exit(3)
    ranks = {pid: server_end}
    with warm_reaper.reaping(ranks):  # the imports: the launcher hears of the end meanwhile
        ready, _, _ = select.select([launcher_end], [], [], 30)
    assert ready and json.loads(launcher_end.recv(4096)) == {"exit": 3}
    assert ranks == {}


# -- a server that dies, a storm of SIGCHLD ---------------------------------------------------

# A server whose import (before it listens, or after: the rest of a rank's imports) takes
# until the test ends it: by SIGKILL, or by an error raised inside the import (as the
# re-entered SIGCHLD handler's KeyError did, inside sympy's import).
DYING_SERVER = """
import os, sys, time
from pathlib import Path
from ddppipe.launching import warm

path, marker, where = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]

def slow_import():
    marker.write_text("importing")
    while marker.read_text() != "fail":
        time.sleep(0.02)
    raise KeyError(1234)

if where == "preload":
    warm.serve(path, slow_import)
else:
    warm.serve(path, lambda: (), ahead=slow_import)
"""


@pytest.mark.parametrize(("where", "death"), [("preload", "kill"), ("ahead", "error")])
def test_a_launcher_starts_cold_at_once_when_its_server_dies_importing(
    tmp_path: Path, where: str, death: str
) -> None:
    """The server dies inside an import, before it listens (SIGKILL: it stays a zombie, its
    caller holds it) or after (an error: it removes its socket): a launcher waiting for it
    starts its rank cold within a second, not after READY_TIMEOUT_S (120 s), and so does the
    next one."""
    path = warm.local_socket(f"ddppipe-warm-dying-{os.getpid()}.sock")
    marker = tmp_path / "marker"
    proc = subprocess.Popen([sys.executable, "-c", DYING_SERVER, str(path), str(marker), where],
                            stderr=subprocess.PIPE)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() or (where == "ahead" and not path.is_socket()):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        env = {**os.environ, env_names.WARM_SOCKET: str(path), env_names.WARM_SERVER: str(proc.pid)}
        command = [sys.executable, "-m", "ddppipe", "resolve-config"]
        result: list[object] = []
        waiting = threading.Thread(target=lambda: result.append(warm_client.spawn(command, env)))
        waiting.start()
        time.sleep(0.3)  # the launcher waits for the server (or for its answer)
        assert waiting.is_alive()
        died = time.monotonic()
        if death == "kill":
            proc.kill()
        else:
            marker.write_text("fail")
        waiting.join(timeout=30)
        assert result == [None] and time.monotonic() - died < 1.5  # cold, at once
        began = time.monotonic()
        assert warm_client.spawn(command, env) is None  # the next launcher: cold at once
        assert time.monotonic() - began < 0.5
        assert Path(f"/proc/{proc.pid}").exists()  # a zombie still: its caller holds it
    finally:
        proc.kill()
        proc.wait(timeout=30)
    if death == "error":
        assert proc.stderr is not None and "KeyError: 1234" in proc.stderr.read().decode()


class SignalOnSend(socket.socket):
    """A launcher's connection whose server end sends the server SIGCHLD as it tells the
    rank's exit: the signal arrives while reaping runs, every time."""

    def sendall(self, data: bytes, flags: int = 0) -> None:
        os.kill(os.getpid(), signal.SIGCHLD)
        super().sendall(data, flags)


def test_sigchld_while_reaping_runs_during_an_import_is_harmless() -> None:
    """While the server imports, SIGCHLD comes as two ended ranks are reaped (a handler reaping
    inside the import was re-entered: the inner call reaped the rank the outer one was still
    to visit, which then raised KeyError inside the import): the import goes on, each launcher
    hears its own rank's exit once."""
    ends = {}
    for code in (3, 4):
        server_end, launcher_end = socket.socketpair()
        pid = os.fork()
        if pid == 0:
            os._exit(code)
        ends[pid] = (SignalOnSend(fileno=server_end.detach()), launcher_end, code)
    for pid in ends:  # both ended, not yet waited for
        while not Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z"):
            time.sleep(0.01)
    ranks = {pid: server for pid, (server, _, _) in ends.items()}
    deadline = time.monotonic() + 30
    with warm_reaper.reaping(ranks):  # "the import": Python runs while the signals come
        os.kill(os.getpid(), signal.SIGCHLD)
        while ranks and time.monotonic() < deadline:
            assert sum(len(str(k)) for k in range(10_000)) == 38_890
    assert ranks == {}
    for _, launcher_end, code in ends.values():
        launcher_end.settimeout(5)
        assert launcher_end.recv(4096) == json.dumps({"exit": code}).encode() + b"\n"  # once
        launcher_end.close()


def test_reaping_tells_each_end_once_and_survives_a_child_waited_for_elsewhere() -> None:
    """(rank's state) -> what its launcher is told: running -> nothing yet; exit 4 -> 4;
    SIGKILL -> -9; waited for by other code already (its status lost) -> 1, never 0."""
    pids = []
    for action in ("run", "exit", "kill", "taken"):
        pid = os.fork()
        if pid == 0:
            if action == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if action == "run":
                time.sleep(30)
            os._exit(4 if action == "exit" else 0)
        pids.append(pid)
    running, exits, killed, taken = pids
    os.waitpid(taken, 0)  # another wait got it first
    for pid in (exits, killed):
        while not Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z"):
            time.sleep(0.01)
    pairs = {pid: socket.socketpair() for pid in pids}
    ranks = {pid: server for pid, (server, _) in pairs.items()}
    warm_reaper.reap(ranks)
    warm_reaper.reap(ranks)  # nothing told twice
    assert list(ranks) == [running]
    told = {}
    for pid in (exits, killed, taken):
        told[pid] = json.loads(pairs[pid][1].recv(4096))
    assert told == {exits: {"exit": 4}, killed: {"exit": -9}, taken: {"exit": 1}}
    os.kill(running, signal.SIGKILL)
    os.waitpid(running, 0)


# -- a server kept between calls ---------------------------------------------------------------

# A kept server (as a call's: started by a caller that then ends) whose preload imports a module
# of the test's; it logs to stderr.
KEPT_SERVER = """
import logging, sys
from pathlib import Path
from ddppipe.launching import warm

logging.basicConfig(level=logging.INFO)
sys.path.insert(0, sys.argv[3])

def preload():
    import kept_probe
    return (kept_probe,)

warm.serve(Path(sys.argv[1]), preload, keep_s=float(sys.argv[2]), caller=int(sys.argv[4]))
"""

KEPT_PROBE = """
import os, sys
open(os.environ["PROBE_OUT"], "w").write(str("kept_probe" in sys.modules))
"""


def kept_call(folder: Path, name: str, keep_s: float) -> tuple[Path, int]:
    """A call (a shell) that started a kept server on ``folder``'s socket ``name`` and ended:
    the socket, once the server listens, and the server's pid."""
    path = folder / f"{warm.KEPT_PREFIX}{name}.sock"
    started = subprocess.run(
        ["sh", "-c", '"$0" -c "$1" "$2" "$3" "$4" $$ </dev/null >/dev/null 2>>"$5" & echo $!',
         sys.executable, KEPT_SERVER, str(path), str(keep_s), str(folder),
         str(folder / f"{name}.log")],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    pid = int(started.stdout)
    deadline = time.monotonic() + 60
    while not path.is_socket():
        assert Path(f"/proc/{pid}").exists() and time.monotonic() < deadline
        time.sleep(0.02)
    return path, pid


def adopt(path: Path) -> int | None:
    """A later call (a forked process that then ends) adopts the server on ``path``: its pid."""
    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(read)
        os.write(write, json.dumps(warm._adopt(path, [])).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as answer:
        pid = json.loads(answer.read())
    os.waitpid(child, 0)
    return pid


def ends_within(pid: int, seconds: float) -> bool:
    """Whether process ``pid`` ended (a zombie included: init reaps it when it will) within
    ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z"):
                return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def kept_folder() -> Iterator[Path]:
    """A private folder of kept servers' sockets, their log and the module they import."""
    folder = Path(tempfile.mkdtemp(prefix="ddppipe-kept-test-"))
    (folder / "kept_probe.py").write_text("VALUE = 1\n")
    yield folder
    for proc in Path("/proc").glob("[0-9]*"):  # (a test that failed: its servers ended)
        with contextlib.suppress(OSError):
            if str(folder).encode() in (proc / "cmdline").read_bytes():
                os.kill(int(proc.name), signal.SIGKILL)
    shutil.rmtree(folder, ignore_errors=True)


def test_a_kept_server_outlives_its_call_serves_the_next_and_ends_when_idle(
    kept_folder: Path, tmp_path: Path
) -> None:
    """Its call ended: the server still listens; a later call adopts it and gets a rank
    forked from it; once that call ended too it ends after its idle time, its socket gone."""
    path, pid = kept_call(kept_folder, "a", keep_s=1.5)
    time.sleep(0.3)  # its caller has ended
    assert path.is_socket() and Path(f"/proc/{pid}").exists()
    assert adopt(path) == pid
    env = {**os.environ, env_names.WARM_SOCKET: str(path), env_names.WARM_SERVER: str(pid),
           "PROBE_OUT": str(tmp_path / "out")}  # fmt: skip
    (tmp_path / "probe.py").write_text(KEPT_PROBE)
    rank = warm_client.spawn([sys.executable, "-m", "ddppipe.training.script.run_script",
                              str(tmp_path / "probe.py")], env)  # fmt: skip
    assert rank is not None and rank.wait(timeout=60) == 0
    assert (tmp_path / "out").read_text() == "True"  # forked from the kept server
    assert ends_within(pid, 10) and not path.exists()
    log = (kept_folder / "a.log").read_text()
    assert "warm server adopted by the call of pid" in log
    assert re.search(r"warm server idle for \d+ s since its last call: ending", log), log


def test_a_kept_server_whose_imported_code_changed_is_stale(kept_folder: Path) -> None:
    """A module it imported was edited since: the next call is refused (it starts a fresh
    server, never the old code), the stale one stops listening and ends."""
    path, pid = kept_call(kept_folder, "b", keep_s=60)
    (kept_folder / "kept_probe.py").write_text("VALUE = 2  # edited\n")
    assert adopt(path) is None
    assert ends_within(pid, 10) and not path.exists()
    log = (kept_folder / "b.log").read_text()
    assert f"warm server stale: {kept_folder / 'kept_probe.py'} changed since" in log


def test_one_idle_kept_server_a_user_the_newest(kept_folder: Path) -> None:
    """An idle kept server ends once another of the user's was started after it (or adopted
    since: it is the newest then), after a twentieth of its keep time idle (a call of its own
    folder a moment later still finds it)."""
    older, older_pid = kept_call(kept_folder, "c", keep_s=20)  # gives way after 1 s idle
    newer, newer_pid = kept_call(kept_folder, "d", keep_s=20)
    assert ends_within(older_pid, 10) and not older.exists()
    assert Path(f"/proc/{newer_pid}").exists() and newer.is_socket()
    os.kill(newer_pid, signal.SIGTERM)
    assert ends_within(newer_pid, 10)
