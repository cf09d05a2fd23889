"""A rank out of memory, named: a CUDA ``torch.OutOfMemoryError``, a host ``MemoryError``, or
a rank killed by a signal (the OOM killer's SIGKILL), with its figures and the fix that fits.

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

OUTCOME = "out of memory"  # the attempt's outcome
HINT = (
    "to fit: launch.strategy: fsdp (shards parameters, gradients and optimizer state), a "
    "smaller train.batch_size, or train.activation_checkpointing: true (recomputes each "
    "block's activations in the backward)"
)
GPU, HOST = "GPU", "host"
# torch's message: "... GPU 0 has a total capacity of 79.19 GiB of which 3.06 GiB is free.
# Including non-PyTorch memory, this process has 76.12 GiB memory in use. ..."
_CAPACITY = re.compile(r"total capacity of ([\d.]+) ([KMGT]i?B)")
_IN_USE = re.compile(r"this process has ([\d.]+) ([KMGT]i?B) memory in use")
_UNITS = {"K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


def kind(error: BaseException) -> str | None:
    """``GPU`` for a CUDA out-of-memory error, ``host`` for ``MemoryError``, else None."""
    if isinstance(error, MemoryError):
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
        return {"kind": HOST, "peak": memory.host_peak_bytes(), "total": memory.host_total_bytes()}
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


def describe(figures: dict[str, Any]) -> str:
    """``peak 10.3 of 80.0 GiB GPU memory``; the OOM killer's kill names its limit."""
    peak, total, what = figures.get("peak"), figures.get("total"), f"{figures['kind']} memory"
    if figures.get("oom_killer"):
        limit = f" at the limit of {memory.gib(total)} GiB {what}" if total else ""
        return f"killed by the OOM killer (SIGKILL){limit}"
    if peak and total:
        return f"peak {memory.gib(peak)} of {memory.gib(total)} GiB {what}"
    if peak:
        return f"peak {memory.readable(peak)} {what}"
    return f"no {what} left" + (f" ({memory.gib(total)} GiB)" if total else "")
