"""A run's summary in a few lines: what it trained, how well, how fast, how its slots ended.

Printed at the end of every ``snakemake`` call (onsuccess/onerror) and by ``ddppipe summary``;
read from the run's files (config, metrics, attempt history: :mod:`~ddppipe.reports.run_files`),
so it costs no torch and works while a run is still training (from its state folder) as after
it. For a SLURM run it is also the one place that asks SLURM's accounting (``sacct``,
:mod:`~ddppipe.reports.slurm_accounting`), on the submitting machine, and sets its figures
beside the run's own. The lines come from :mod:`~ddppipe.reports.result_lines` (what it
trained, how well) and :mod:`~ddppipe.reports.slot_lines` (its slots, hours and waste).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from ddppipe.reports import result_lines, run_files, slot_lines, slurm_accounting


@dataclass
class Summary:
    run: str
    what: str  # the task (or script) and its file's SHA-256
    lines: list[tuple[str, str]] = field(default_factory=list)

    def text(self) -> str:
        width = max((len(k) for k, _ in self.lines), default=0)
        body = "\n".join(f"  {k.ljust(width)}  {v}" for k, v in self.lines)
        return f"run {self.run}: {self.what}\n{body}"


def build(run_dir: Path) -> Summary:
    """The summary of the run in ``run_dir`` (``results/<run>``)."""
    files = run_files.load(run_dir)
    about, attempts = files.about, files.attempts
    summary = Summary(files.layout.run, result_lines.what(about))
    records = slurm_accounting.records(files.jobs)
    attempts = slurm_accounting.out_of_memory_named(attempts, records)
    origin = slurm_accounting.origin(attempts, records)
    summary.lines.extend(result_lines.lines(about, files.history, origin))
    summary.lines.extend(result_lines.pruned(about, files.evaluation))
    if attempts:
        summary.lines.append(slot_lines.endings(attempts))
        summary.lines.extend(slot_lines.efficiency(about.spec, attempts))
        if files.jobs:
            summary.lines.append(slurm_accounting.line(attempts, records))
        if origin is not None:
            summary.lines.append(slot_lines.wall(attempts, origin, time.time()))
    export = files.layout.export
    outputs = [p for p in (export.weights, export.outputs, export.provenance) if p.exists()]
    if outputs:
        summary.lines.append(("results", ", ".join(str(p) for p in outputs)))
    if attempts:  # last: the line a failed snakemake call ends with
        summary.lines.extend(slot_lines.hangs(attempts))
        summary.lines.extend(slot_lines.failure(attempts))
    if files.early_failure is not None:
        summary.lines.append(("failed", files.early_failure.text()))
    return summary


def text(run_dir: Path) -> str:
    return build(run_dir).text()
