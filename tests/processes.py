"""Finding the training workers of a run, and whether their preemption handlers are in."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from ddppipe.runstate import node_beats
from ddppipe.runstate.state import StateDir
from ddppipe.settings.layout import RunLayout
from ddppipe.training.measuring import heartbeat


def worker_pids(workdir: Path) -> list[int]:
    """PIDs of the ``ddppipe train`` workers (not agents or srun) running in ``workdir``.

    The SLURM test cluster's nodes are network namespaces: they share the host's process table.
    """
    return [
        pid for pid, argv in processes_in(workdir)
        if "agent" not in argv and Path(argv[0]).name != "srun"
        and any(argv[i : i + 2] == ["ddppipe", "train"] for i in range(len(argv)))
    ]  # fmt: skip


def catches_sigusr1(pid: int) -> bool:
    """Whether ``pid`` has a SIGUSR1 handler installed (the training loop's preemption Guard)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    caught = next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(caught, 16) >> (signal.SIGUSR1 - 1) & 1)


def guarded_workers(workdir: Path, world_size: int) -> list[int] | None:
    """The workers once all ``world_size`` of them catch SIGUSR1 (their training loop runs)."""
    pids = worker_pids(workdir)
    return pids if len(pids) == world_size and all(map(catches_sigusr1, pids)) else None


def start_guarded_launch(
    args: list[str], run_dir: Path, world_size: int = 2, poll_s: float = 0.1
) -> tuple[subprocess.Popen, Path]:
    """`ddppipe launch ARGS` in the background (its output in ``run_dir/launch.log``),
    returned once all ``world_size`` workers catch SIGUSR1 (looked for every ``poll_s``)."""
    log = run_dir / "launch.log"
    with log.open("w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "ddppipe", "launch", *args],
                                cwd=run_dir, stdout=sink, stderr=subprocess.STDOUT)  # fmt: skip
    deadline = time.monotonic() + 120
    while not guarded_workers(run_dir, world_size):
        assert proc.poll() is None, f"launch exited {proc.returncode}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"no training workers:\n{log.read_text()}"
        time.sleep(poll_s)
    return proc, log


def processes_in(workdir: Path) -> list[tuple[int, list[str]]]:
    """(PID, argv) of every process whose working directory is ``workdir``, by PID."""
    found, here = [], workdir.resolve()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "cwd").resolve() != here:
                continue
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # exited meanwhile
        if argv[-1] == "":
            argv.pop()  # cmdline ends in a NUL
        if argv:  # (a zombie's is empty)
            found.append((int(entry.name), argv))
    return sorted(found)


def hang_report(workdir: Path, run: RunLayout) -> str:
    """What the run ``run`` in ``workdir`` that outlived its test's wait is doing: the
    processes there (each with its state, kernel wait, and Python and native stacks by
    py-spy), every rank's Python stack by its own dump too (the heartbeat's signal,
    :mod:`ddppipe.training.measuring.heartbeat`) and heartbeat, and its train log's tail."""
    lines = ["processes:"]
    for pid, argv in processes_in(workdir):
        command = " ".join(argv)[:300]
        try:
            status = Path(f"/proc/{pid}/status").read_text().splitlines()
            wchan = Path(f"/proc/{pid}/wchan").read_text()
        except OSError:
            status, wchan = [], "?"
        proc_state = next((s.split(None, 1)[1] for s in status if s.startswith("State:")), "?")
        lines.append(f"  {pid} [{proc_state}; wchan {wchan or '-'}] {command}")
        spy = [str(Path(sys.executable).parent / "py-spy"), "dump", "--native", "--pid", str(pid)]
        try:
            dump = subprocess.run(spy, capture_output=True, text=True, timeout=30)
            lines.append(textwrap.indent((dump.stdout + dump.stderr)[-6000:], "    "))
        except (OSError, subprocess.TimeoutExpired) as e:
            lines.append(f"    (py-spy: {e})")
    for pid in worker_pids(workdir):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, heartbeat.DUMP_SIGNAL)
    time.sleep(3)
    state = StateDir(workdir / run.state)
    found_files = sorted(state.watchdog.glob("rank-*")) if state.watchdog.is_dir() else []
    with contextlib.suppress(OSError, ValueError, KeyError):  # the nodes' own beats and stacks
        local = node_beats.local_folder(json.loads(state.slot.read_text())["launcher"], "")
        found_files += sorted(local.parent.glob(f"{local.name}*/rank-*"))
    for found in found_files:
        lines.append(f"{found}:\n{found.read_text(errors='replace')[-6000:]}")
    log = workdir / run.log("train")
    tail = log.read_text(errors="replace")[-4000:] if log.is_file() else "(no log)"
    lines.append(f"{log} (its end):\n{tail}")
    return "\n".join(lines)
