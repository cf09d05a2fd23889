"""This process's memory as the kernel counts it: its peak, the limit it runs under, and the
OOM killer's kills in its cgroup. No torch.
"""

from __future__ import annotations

import contextlib
import os
import resource
from pathlib import Path

GIB = 1024**3
CGROUP_ROOT = Path("/sys/fs/cgroup")


def host_peak_bytes() -> int:
    """This process's peak resident memory (``ru_maxrss``: kB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def address_space_limit() -> int | None:
    """This process's address-space limit (``RLIMIT_AS``, ``ulimit -v``) in bytes; None where
    there is none."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    return None if soft == resource.RLIM_INFINITY else soft


def _cgroup_dirs(pid: int | str = "self") -> list[Path]:
    """The memory cgroup folders of process ``pid``, innermost first: cgroup v2's (its
    ``0::`` line) and v1's memory controller's; [] where /proc or /sys does not say."""
    found = []
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        hierarchy, controllers, path = [*line.split(":", 2), "", ""][:3]
        if hierarchy == "0":
            root = CGROUP_ROOT
        elif "memory" in controllers.split(","):
            root = CGROUP_ROOT / "memory"
        else:
            continue
        folder = root / path.lstrip("/")
        while folder.is_dir() and (folder == root or root in folder.parents):
            found.append(folder)
            if folder == root:
                break
            folder = folder.parent
    return found


def host_total_bytes() -> int | None:
    """The memory this process may use: the machine's, or its cgroup's limit when lower (a
    SLURM job's ``--mem``); None where neither can be read."""
    sizes = []
    with contextlib.suppress(OSError, ValueError):
        sizes.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    for folder in _cgroup_dirs():
        for name in ("memory.max", "memory.limit_in_bytes"):
            with contextlib.suppress(OSError, ValueError):
                sizes.append(int((folder / name).read_text().strip()))  # "max": ValueError
    return min(sizes, default=None)


def oom_kills(pid: int | str = "self") -> int | None:
    """The OOM killer's kills so far in the cgroup of process ``pid`` (``oom_kill`` of v2's
    ``memory.events`` or v1's ``memory.oom_control``); None where the cgroup does not say."""
    for folder in _cgroup_dirs(pid):
        for name in ("memory.events", "memory.oom_control"):
            try:
                lines = (folder / name).read_text().splitlines()
            except OSError:
                continue
            for line in lines:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    with contextlib.suppress(ValueError):
                        return int(value)
    return None


def readable(size: float) -> str:
    """Bytes in the unit that reads best: ``1.2 GiB``, ``350 MiB``, ``12 KiB``."""
    if size >= GIB:
        return f"{size / GIB:.1f} GiB"
    if size >= 1024**2:
        return f"{size / 1024**2:.0f} MiB"
    return f"{size / 1024:.0f} KiB"


def gib(size: float) -> str:
    """Bytes in GiB, one decimal (two below 1 GiB: ``0.35``)."""
    value = size / GIB
    return f"{value:.2f}" if value < 1 else f"{value:.1f}"
