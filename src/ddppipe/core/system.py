"""This process's machine: the CPUs it may use and what they compute natively, the git commit of
a work tree."""

from __future__ import annotations

import contextlib
import os
import platform
import resource
import subprocess
from pathlib import Path
from typing import Any


def process_alive(pid: int) -> bool:
    """Does process ``pid`` of this machine still run (one of another user's included)? A
    zombie does not: it ended, its parent has not waited for it yet (a warm server whose
    caller holds it until the call's end)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:  # (ended since)
        return False
    except OSError:  # (/proc hides it: it exists)
        return True
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")  # the state after the name


def available_cpus() -> int:
    """CPUs this process may use (SLURM's allocation on this node, or the affinity mask)."""
    if "SLURM_CPUS_ON_NODE" in os.environ:
        return int(os.environ["SLURM_CPUS_ON_NODE"])
    return len(os.sched_getaffinity(0))


# The CPU flags of a native bfloat16 multiply: x86's AVX512-BF16 or AMX-BF16 (/proc/cpuinfo's
# "flags"), Arm's BF16 extension ("Features"). Without them torch emulates bfloat16 in float32
# and rounds: the MNIST CNN's bf16 step took 3.49 s against 0.42 s in fp32 (one thread, an
# AVX2-only AMD EPYC, 2026-11-27).
BF16_FLAGS = {"flags": {"avx512_bf16", "amx_bf16"}, "Features": {"bf16"}}
CPUINFO = Path("/proc/cpuinfo")  # what this machine's CPU is (a test names another machine's)


def _cpuinfo_field(cpuinfo: Path | None, keys: set[str]) -> tuple[str, str] | None:
    """The first ``key: value`` line of ``cpuinfo`` (None: :data:`CPUINFO`) whose key is one
    of ``keys`` (stripped); None when there is none or the file cannot be read (no Linux)."""
    try:
        lines = (cpuinfo or CPUINFO).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() in keys:
            return key.strip(), value.strip()
    return None


def cpu_computes_bf16(cpuinfo: Path | None = None) -> bool:
    """Whether this machine's CPU (``cpuinfo``'s, None: :data:`CPUINFO`) multiplies bfloat16
    natively (:data:`BF16_FLAGS`); False where it cannot be read (no Linux): float32 is never
    emulated. Asked where the ranks start (:mod:`ddppipe.parallel.precision`)."""
    found = _cpuinfo_field(cpuinfo, set(BF16_FLAGS))
    return found is not None and bool(BF16_FLAGS[found[0]] & set(found[1].split()))


def cpu_model(cpuinfo: Path | None = None) -> str:
    """This machine's CPU model ("AMD EPYC", "Intel(R) Xeon(R) Platinum 8481C CPU"): x86's
    "model name", else the machine type (an Arm's /proc/cpuinfo names no model)."""
    found = _cpuinfo_field(cpuinfo, {"model name"})
    return found[1] if found else platform.machine()


def git_commit(cwd: Path | None = None) -> dict[str, Any]:
    """HEAD's commit and whether the work tree has uncommitted changes (None outside git)."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=cwd, capture_output=True, text=True, check=True, timeout=30
        ).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain"))}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def raise_open_files_limit() -> tuple[int, int]:
    """Raise this process's soft limit on open files to its hard limit; the (soft, hard) now.

    A process group's rank 0 holds a socket to every rank it gathers from (gloo: one a peer
    and group), more than the usual soft limit of 1,024 past a few hundred ranks, while the
    hard limit is usually far higher (as torchrun, Ray and most MPI launchers do).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        with contextlib.suppress(ValueError, OSError):  # (the kernel's nr_open): it stays
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)
