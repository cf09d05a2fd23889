"""Each CPU training process on cores of its own.

Local rank ``r`` of ``n`` processes with ``t`` threads each gets the ``r``-th ``t`` of the CPUs
the job holds, in CPU order, when the job holds exactly ``n`` x ``t`` of them: a SLURM
allocation, or a local run sharing out the machine. A mask with more CPUs may be shared with
other jobs (two Snakemake jobs side by side see the same mask), so it is left to the kernel, as
is one with fewer. Unbound, the kernel moved the ranks and their gloo threads between cores:
bound, the default 2 x 1 run trained 10 % more images/s (4,184-4,413 against 3,876-3,967 on
the 2-core CI machine, 2026-11-25) with the same weights. GPU ranks are left unbound.
"""

from __future__ import annotations

import contextlib
import logging
import os

log = logging.getLogger(__name__)


def share(
    cpus: list[int], local_rank: int, local_world_size: int, threads: int
) -> list[int] | None:
    """The CPUs of ``local_rank``; None unless ``cpus`` holds exactly every rank's threads."""
    if threads < 1 or local_world_size < 1 or len(cpus) != local_world_size * threads:
        return None
    ordered = sorted(cpus)
    return ordered[local_rank * threads : (local_rank + 1) * threads]


def bind(local_rank: int, local_world_size: int, threads: int) -> list[int] | None:
    """Bind every thread of this process to its share of the CPUs; return them, or None."""
    mine = share(list(os.sched_getaffinity(0)), local_rank, local_world_size, threads)
    if mine is None:
        return None
    for task in os.listdir("/proc/self/task"):  # threads started already; later ones inherit
        with contextlib.suppress(ProcessLookupError, PermissionError):  # a thread that ended
            os.sched_setaffinity(int(task), mine)
    log.info("local rank %d bound to CPUs %s", local_rank, mine)
    return mine
