"""Keep freed memory in the process heap, so that training steps do not page-fault on CPU.

glibc serves large allocations (over 128 KiB at first) with fresh ``mmap`` pages and returns
them on free; every training step then page-faults its activations in again (~6,000 faults
per step here, a third of the step's CPU time). Raising the mmap and trim thresholds keeps
those blocks in the heap for reuse. Measured: +40-60 % images/s per CPU on this model.
"""

from __future__ import annotations

import ctypes
import logging
import sys

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's maximum: blocks above it are still mmap'ed
TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds; return whether it applied (glibc Linux only)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    applied = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
    if not applied:
        log.warning("mallopt refused the heap thresholds; training may page-fault more")
    return applied
