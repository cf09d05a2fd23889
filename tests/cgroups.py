"""Memory cgroups for tests: a limit on a group of processes, as a SLURM node that enforces a
job's ``--mem`` (cgroup ``ConstrainRAMSpace``) puts one on the job's processes."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")


def place() -> tuple[Path, str, str, bool]:
    """Where this process may make a memory cgroup, its limit's file, its swap limit's file,
    and whether that file counts memory and swap together: cgroup v1's memory controller (a
    child of this process's cgroup) or v2's (a child of its cgroup's parent, whose children get
    the controller)."""
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    entries = [line.split(":", 2) for line in lines]
    for _, controllers, path in entries:
        if "memory" in controllers.split(","):
            where = CGROUP / "memory" / path.lstrip("/")
            return where, "memory.limit_in_bytes", "memory.memsw.limit_in_bytes", True
    own = CGROUP / next(path for hierarchy, _, path in entries if hierarchy == "0").lstrip("/")
    parent = own if own == CGROUP else own.parent
    (parent / "cgroup.subtree_control").write_text("+memory")
    return parent, "memory.max", "memory.swap.max", False


@contextlib.contextmanager
def memory_limited(limit: int, name: str) -> Iterator[Path]:
    """A new memory cgroup ``name`` limited to ``limit`` bytes, swap included; removed after
    (the processes still in it moved back to the cgroup it was made in)."""
    where, limit_file, swap_file, together = place()
    made = where / f"ddppipe-test-{os.getpid()}-{name}"
    made.mkdir()
    try:
        (made / limit_file).write_text(str(limit))
        if (made / swap_file).exists():  # only where the kernel accounts swap
            (made / swap_file).write_text(str(limit if together else 0))
        yield made
    finally:
        procs = (made / "cgroup.procs").read_text().split()
        for pid in procs:
            with contextlib.suppress(OSError):  # (a process that has ended meanwhile)
                (where / "cgroup.procs").write_text(pid)
        made.rmdir()


def enter(cgroup: Path, pid: int | None = None) -> None:
    """Move process ``pid`` (None: this one) into ``cgroup``: its later children start there."""
    (cgroup / "cgroup.procs").write_text(str(pid or os.getpid()))


def peak_bytes(cgroup: Path) -> int | None:
    """The most memory ``cgroup``'s processes held together (v1 ``memory.max_usage_in_bytes``,
    v2 ``memory.peak``: page cache included); None where the kernel does not say."""
    for name in ("memory.max_usage_in_bytes", "memory.peak"):
        with contextlib.suppress(OSError, ValueError):
            return int((cgroup / name).read_text())
    return None
