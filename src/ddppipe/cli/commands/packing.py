"""The packing subcommands: a packed trial's train job, and an allocation's node worker."""

from __future__ import annotations

from pathlib import Path


def pack_trial(pool: Path, config_path: Path, order: int, launch: list[str]) -> int:
    """``ddppipe pack-trial``: train a trial in the sweep's held allocations (the waiting
    trials start in their ``order``); its status."""
    from ddppipe.packing import client

    return client.run(pool, config_path, launch[1:] if launch[:1] == ["--"] else launch, order)


def pack_worker(pool: Path, slots: int, signal_seconds: int, stop_signal: str, nproc: int,
                use: str, precision: str) -> int:  # fmt: skip
    """``ddppipe pack-worker``: check this node of an allocation, then run the pool's trials
    on it."""
    from ddppipe.packing import worker

    return worker.serve(pool, slots, signal_seconds, stop_signal, (nproc, use, precision))
