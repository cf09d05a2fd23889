"""A rank out of memory, named: a CUDA ``torch.OutOfMemoryError``, a host ``MemoryError`` or
torch's CPU allocator's ``can't allocate memory`` (an address-space limit, ``ulimit -v``, or
strict overcommit), or a rank killed by a signal (the OOM killer's SIGKILL), with its figures
and the fix that fits.

A rank that raises records the figures itself (:func:`figures`, called by
:func:`ddppipe.runstate.failures.record`); a rank killed outright cannot, so whoever watches it
(the local worker group, or the node's torchrun agent) records it (:func:`killed`) and says
"the OOM killer" only when the cgroup's ``oom_kill`` counter rose while it ran. No torch
import: torch is read from ``sys.modules`` where a rank has it.
"""

from __future__ import annotations

import re
import signal
import sys
from typing import Any

from ddppipe.core import memory

HINT = (
    "to fit: launch.strategy: fsdp (shards parameters, gradients and optimizer state), a "
    "smaller train.batch_size, or train.activation_checkpointing: true (recomputes each "
    "block's activations in the backward)"
)
GPU, HOST = "GPU", "host"
OOM_KILLER = "the OOM killer (SIGKILL)"  # who killed a rank out of memory
SLURM_LIMIT = "SLURM's memory limit (SIGKILL; sacct: OUT_OF_MEMORY)"
# torch's message: "... GPU 0 has a total capacity of 79.19 GiB of which 3.06 GiB is free.
# Including non-PyTorch memory, this process has 76.12 GiB memory in use. ..."
_CAPACITY = re.compile(r"total capacity of ([\d.]+) ([KMGT]i?B)")
_IN_USE = re.compile(r"this process has ([\d.]+) ([KMGT]i?B) memory in use")
_UNITS = {"K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}
# torch's CPU allocator (a RuntimeError): "[enforce fail at alloc_cpu.cpp:117] err == 0.
# DefaultCPUAllocator: can't allocate memory: you tried to allocate 4294967296 bytes. ..."
_CPU_ALLOCATOR = "DefaultCPUAllocator: can't allocate memory"
_ASKED = re.compile(r"you tried to allocate (\d+) bytes")


def kind(error: BaseException) -> str | None:
    """``GPU`` for a CUDA out-of-memory error, ``host`` for ``MemoryError`` and torch's CPU
    allocator's failure, else None."""
    if isinstance(error, MemoryError) or _CPU_ALLOCATOR in str(error):
        return HOST
    torch = sys.modules.get("torch")
    oom = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    if oom is not None and isinstance(error, oom):
        return GPU
    if isinstance(error, RuntimeError) and "CUDA out of memory" in str(error):  # older torch
        return GPU
    return None


def _size(match: re.Match[str] | None) -> int | None:
    if match is None:
        return None
    return int(float(match.group(1)) * _UNITS[match.group(2)[0]])


def figures(error: BaseException) -> dict[str, Any] | None:
    """The memory figures of ``error`` when it is an out-of-memory error, else None: its
    ``kind`` and the rank's ``peak`` and ``total`` bytes of that memory (None where unknown).
    On a GPU torch's peak reserved memory and the device's size, else what its message says."""
    found = kind(error)
    if found == HOST:
        return _host_figures(str(error))
    if found != GPU:
        return None
    text = str(error)
    peak, total = _size(_IN_USE.search(text)), _size(_CAPACITY.search(text))
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_initialized():
            device = torch.cuda.current_device()
            peak = max(peak or 0, torch.cuda.max_memory_reserved(device)) or None
            total = torch.cuda.get_device_properties(device).total_memory
    except Exception:  # the figures are extras: the error's record matters
        pass
    return {"kind": GPU, "peak": peak, "total": total}


def _host_figures(text: str) -> dict[str, Any]:
    """A host failure's figures; with the bytes the CPU allocator was asked for (``asked``)
    and the address-space limit (``address_space``, ``ulimit -v``) where there are."""
    found: dict[str, Any] = {
        "kind": HOST, "peak": memory.host_peak_bytes(), "total": memory.host_total_bytes()
    }  # fmt: skip
    asked = _ASKED.search(text)
    if asked:
        found["asked"] = int(asked.group(1))
    limit = memory.address_space_limit()
    if limit is not None:
        found["address_space"] = limit
    return found


def signal_name(signum: int) -> str:
    """``SIGKILL`` for 9; ``signal 99`` for a number no signal has."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def killed_figures(oom_killer: bool) -> dict[str, Any] | None:
    """The figures of a rank the OOM killer killed (the limit it reached), else None."""
    return {"kind": HOST, "peak": None, "total": memory.host_total_bytes(),
            "oom_killer": True} if oom_killer else None  # fmt: skip


def slurm_figures(peak: int | None, total: int | None) -> dict[str, Any]:
    """The figures of a rank SLURM's memory limit killed (sacct's ``OUT_OF_MEMORY``): the
    slot's largest task's peak (sacct's MaxRSS) and the limit of a node (its ReqMem)."""
    return {"kind": HOST, "peak": peak, "total": total, "oom_killer": True, "by": SLURM_LIMIT}


def describe(figures: dict[str, Any]) -> str:
    """``peak 10.3 of 80.0 GiB GPU memory``; a kill names its killer, the limit and the peak
    where known; a host allocation names its size and the address-space limit it ran under."""
    peak, total, what = figures.get("peak"), figures.get("total"), f"{figures['kind']} memory"
    if figures.get("oom_killer"):
        limit = f" at the limit of {memory.gib(total)} GiB {what}" if total else ""
        seen = f", peak {memory.readable(peak)}" if peak else ""
        return f"killed by {figures.get('by', OOM_KILLER)}{limit}{seen}"
    if peak and total:
        text = f"peak {memory.gib(peak)} of {memory.gib(total)} GiB {what}"
    elif peak:
        text = f"peak {memory.readable(peak)} {what}"
    else:
        text = f"no {what} left" + (f" ({memory.gib(total)} GiB)" if total else "")
    return text + _allocation(figures)


def _allocation(figures: dict[str, Any]) -> str:
    """``, asking for 4.0 GiB more under an address-space limit of 1.5 GiB (ulimit -v)``."""
    asked, limit = figures.get("asked"), figures.get("address_space")
    parts = [f"asking for {memory.readable(asked)} more"] if asked else []
    if limit:
        parts.append(f"under an address-space limit of {memory.readable(limit)} (ulimit -v)")
    return ", " + " ".join(parts) if parts else ""
