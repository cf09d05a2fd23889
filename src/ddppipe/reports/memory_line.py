"""The summary's memory line: the peak per rank of the last measured slot, host and GPU, each
with its rank and node, and what the model and optimizer held of it
(:mod:`ddppipe.training.measuring.rank_memory`'s record, read without torch)::

    memory  peak per rank: 1.2 GiB host (rank 0 on cn07), 10.3 of 80.0 GiB GPU (rank 3 on
            cn08; 11.0 GiB reserved): parameters 410 MiB, gradients 410 MiB, optimizer
            state 820 MiB, activations and other 8.7 GiB
"""

from __future__ import annotations

from typing import Any

from ddppipe.core.memory import gib, readable

PARTS = (("parameters", "parameters"), ("gradients", "gradients"),
         ("optimizer", "optimizer state"))  # fmt: skip


def line(figures: dict[str, Any]) -> tuple[str, str] | None:
    """The line for a slot's efficiency ``figures``; None where it recorded no memory."""
    record = figures.get("memory")
    if not record or "host_peak" not in record:
        return None
    text = f"peak per rank: {readable(record['host_peak'])} host " + (
        f"(rank {record['host_rank']} on {record['host_node']})"
    )
    peak = record["host_peak"]
    if "gpu_peak" in record:
        peak = record["gpu_peak"]
        text += (f", {gib(peak)} of {gib(record['gpu_total'])} GiB GPU (rank "
                 f"{record['gpu_rank']} on {record['gpu_node']}; "
                 f"{gib(record['gpu_reserved'])} GiB reserved)")  # fmt: skip
    parts = [(words, record[key]) for key, words in PARTS if key in record]
    if parts:
        rest = max(0, peak - sum(size for _, size in parts))
        shown = ", ".join(f"{words} {readable(size)}" for words, size in parts)
        text += f": {shown}, activations and other {readable(rest)}"
    return "memory", text
