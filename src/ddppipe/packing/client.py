"""The train rule's side of a packed trial (``ddppipe pack-trial``): queue the trial's ticket
(its run and data: the node builds the same launch command the rule gives), keep an allocation
held or coming while trials wait, and wait for the trial's exit status, which becomes the
job's. Run as a local job of the submitting Snakemake; it holds no core."""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from types import FrameType

from ddppipe.packing import allocation as allocations
from ddppipe.packing import tickets
from ddppipe.packing.pool import Pool
from ddppipe.settings import run_spec

log = logging.getLogger(__name__)

POLL_S = 0.5


def run(pool_root: Path, config_path: Path, command: list[str], order: int = 0) -> int:
    """Train the trial of ``config_path`` (its launch ``command``; its place in the sweep
    ``order``: the waiting trials start in it) in the pool's allocations."""
    spec = run_spec.load(config_path)
    held = allocations.Allocation.of(spec)
    pool = Pool(pool_root)
    workdir = os.getcwd()
    ticket = tickets.of_launch(spec.run, spec.kind, held.trial.nodes, order, command)
    if pool.put(ticket):
        log.info("%s waits for a slot of the sweep's allocations (%s)", spec.run, pool.root)
    else:
        log.info("%s trains in an allocation already: waiting for it", spec.run)

    def cancelled(signum: int, frame: FrameType | None) -> None:
        pool.withdraw(spec.run)  # a trial that trains already goes on; the next call waits
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, cancelled)
    # at once only when no allocation is coming: the scheduler's load (squeue) stays one call
    # every CHECK_EVERY_S seconds, however many trials the sweep has
    allocations.ensure(pool, held, workdir, force=not pool.expected())
    while (result := pool.result(spec.run)) is None:
        if refused := pool.refusal(spec.run):
            log.error("%s: its ticket was refused: %s", spec.run, refused)
            return 1
        time.sleep(POLL_S)
        allocations.ensure(pool, held, workdir)
    code = int(result["exit"])
    log.info("%s ended in allocation %s, node %s, slot %s: exit %d", spec.run, result["job"],
             result["node"], result["slot"], code)  # fmt: skip
    return code if code >= 0 else 128 - code
