"""This process's start-up as clock readings: when the kernel started it, when ddppipe's command
began in it, when the container it runs in started, and the marks it leaves as it gets ready
(the parts of a slot's start-up are derived from them: :mod:`ddppipe.runstate.startup`).

Unix times, comparable between the processes of a node (and, as far as their clocks agree,
between nodes). A process's start comes from ``/proc/<pid>/stat`` (the kernel's count since
boot, in clock ticks, placed on the wall clock through ``CLOCK_BOOTTIME``).
"""

from __future__ import annotations

import os
import time

ENTERED = time.time()  # ddppipe's command began in this process (``ddppipe.cli.main`` imports this)
# an ancestor of these names is the container's runtime: Apptainer's (Singularity's) starter
CONTAINER_RUNTIMES = ("starter", "apptainer", "singularity")
_MARKS: dict[str, float] = {}


def _stat(pid: int | str) -> tuple[str, int, int] | None:
    """Process ``pid``'s command name, parent and start (clock ticks since boot); None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    comm, rest = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :]
    fields = rest.split()  # from the 3rd field on: state, ppid, ... starttime (the 22nd)
    return comm, int(fields[1]), int(fields[19])


def _boot() -> float:
    """The Unix time the machine booted (the origin of /proc's start times)."""
    return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)


def started(pid: int | str = "self") -> float | None:
    """Unix time process ``pid`` (this one) started; None where /proc cannot tell."""
    found = _stat(pid)
    return None if found is None else _boot() + found[2] / os.sysconf("SC_CLK_TCK")


def container_started(pid: int | str = "self") -> float | None:
    """Unix time the container runtime that started process ``pid`` (this one) started: its
    outermost ancestor of :data:`CONTAINER_RUNTIMES` directly above it; None outside one."""
    found = _stat(pid)
    ticks = None
    while found is not None and found[1] > 1:
        parent = _stat(found[1])
        if parent is None or not parent[0].lower().startswith(CONTAINER_RUNTIMES):
            break
        ticks, found = parent[2], parent
    return None if ticks is None else _boot() + ticks / os.sysconf("SC_CLK_TCK")


def mark(name: str, at: float | None = None) -> None:
    """Note that this process reached ``name`` (a key of :data:`ddppipe.runstate.startup.MARKS`)
    now (or at ``at``); the first reading of a name stays."""
    _MARKS.setdefault(name, time.time() if at is None else at)


def marks() -> dict[str, float]:
    """The marks this process left so far."""
    return dict(_MARKS)


def own(prefix: str = "") -> dict[str, float]:
    """This process's start as marks (``prefix`` before each name): its container's start
    (``container``), its own (``process``), ddppipe's command's (``entered``), with the marks
    it left; a container's start only where it is earlier than the process's."""
    found: dict[str, float] = {}
    process = started()
    container = container_started()
    if container is not None and process is not None and container < process:
        found["container"] = container
    if process is not None:
        found["process"] = process
    found["entered"] = max(ENTERED, process or 0.0)  # a forked process: no command of its own
    found.update(_MARKS)
    return {prefix + k: v for k, v in found.items()}
