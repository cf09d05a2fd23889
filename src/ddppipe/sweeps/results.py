"""A sweep's results in one call: its table, best trial and TensorBoard HParams view, written
from what its trials left so far (rule sweep_table, and the end of every snakemake call)."""

from __future__ import annotations

from pathlib import Path

from ddppipe.packing import allocation_cost
from ddppipe.settings.layout import SweepLayout
from ddppipe.settings.sweep import Sweep
from ddppipe.sweeps import hparams, table, trials


def save(found: trials.Table, csv: Path | None = None, best: Path | None = None) -> None:
    """Write the table (default: the sweep's trials.csv), the best trial (best.json) and the
    trials' HParams sessions."""
    table.write(found, csv or found.layout.trials_csv, best or found.layout.best)
    hparams.write(found)


def after_call(sweep: Sweep, results: Path) -> str:
    """The sweep's results written from what exists under ``results`` (a failed trial's row
    says why, pending ones are listed), and its top trials as text to print."""
    found = trials.collect(trials.document(sweep), results)
    save(found)
    pool = SweepLayout(sweep.name, results).pack
    allocations = allocation_cost.write(pool) if sweep.pack is not None else None
    return table.text(found) + (f"\n  {allocations}" if allocations else "")
