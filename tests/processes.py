"""Finding the training workers of a run, and whether their preemption handlers are in."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path


def worker_pids(workdir: Path) -> list[int]:
    """PIDs of the ``ddppipe train`` workers (not agents or srun) running in ``workdir``.

    The SLURM test cluster's nodes are network namespaces: they share the host's process table.
    """
    found = subprocess.run(["pgrep", "-f", "ddppipe train"], capture_output=True, text=True)
    pids = []
    for pid in map(int, found.stdout.split()):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            cwd = Path(f"/proc/{pid}/cwd").resolve()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # exited meanwhile
        if cwd != workdir.resolve() or "agent" in argv or Path(argv[0]).name == "srun":
            continue
        if any(argv[i : i + 2] == ["ddppipe", "train"] for i in range(len(argv))):
            pids.append(pid)
    return pids


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
