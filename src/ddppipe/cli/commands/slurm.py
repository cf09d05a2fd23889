"""``ddppipe submit`` and ``ddppipe head``: the submitting snakemake as a SLURM job
(ddppipe.slurm.head)."""

from __future__ import annotations

import sys

from ddppipe.slurm import head as ddp_head


def submit(time: str, partition: str | None, account: str | None, args: list[str]) -> int:
    """``ddppipe submit [--time T] -- SNAKEMAKE_ARGS``: submit the head job; print its id."""
    args = args[1:] if args[:1] == ["--"] else args
    job = ddp_head.submit(args, time, partition, account)
    print(f"submitted head job {job}: snakemake {' '.join(args)}; its log: "
          f"{ddp_head.LOG.replace('%j', job)}")  # fmt: skip
    return 0


def head(args: list[str]) -> int:
    """``ddppipe head -- SNAKEMAKE_ARGS`` (in the head job): unlock, run, requeue near the end."""
    args = args[1:] if args[:1] == ["--"] else args
    sys.stderr.flush()
    return ddp_head.run_head(args)
