"""A sweep's table rendered: ``trials.csv`` (one row per trial: how it ended, its values, the
metric, what it cost), ``best.json`` (the best trial, by the metric and per allocated hour) and
the top trials as text, printed after every ``snakemake`` call; from the trials as
:mod:`ddppipe.sweeps.trials` reads them. Written by ``ddppipe sweep-table`` (rule sweep_table)
and after every call (then with the trials that failed or have not run yet).
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

from ddppipe.core import atomic
from ddppipe.sweeps.trials import FAILED, Table, TrialResult

TOP = 5  # trials printed after a snakemake call


def target_column(target: float) -> str:
    """The column of the seconds to a test accuracy, e.g. ``time_to_99pct_s``."""
    return f"time_to_{100 * target:g}pct_s"


def _cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(value)


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def rows(table: Table) -> list[dict[str, Any]]:
    """The table's rows: trial, outcome, each parameter, the metric (final, best and its
    epoch), epochs, time to each accuracy target, images/s, hours held and training, queue,
    goodput (the share of the node time held that trained kept steps)."""
    m = table.metric
    out = []
    for t in table.trials:
        cost = t.cost
        row: dict[str, Any] = {"trial": t.name, "outcome": t.outcome_text}
        row.update({k: _cell(t.values.get(k)) for k in table.keys})
        row.update({
            m: _round(t.final, 6), f"best_{m}": _round(t.best, 6), f"best_{m}_epoch": t.best_epoch,
            "epochs": t.epochs,
        })  # fmt: skip
        for target in table.targets:
            row[target_column(target)] = _round(t.reached.get(target), 1)
        row.update({
            "images_per_s": _round(t.images_per_s, 1),
            "unit": cost.unit if cost else None, "units": cost.units if cost else None,
            "hours_held": _round(cost.held_h, 6) if cost else None,
            "hours_training": _round(cost.training_h, 6) if cost else None,
            "queue_s": _round(cost.queue_s, 1) if cost else None,
            "goodput": _round(cost.goodput, 4) if cost else None,
        })  # fmt: skip
        out.append(row)
    return out


def csv_text(table: Table) -> str:
    """The table as CSV; an empty cell: no value (not reached, not measured, not run)."""
    found = rows(table)
    buffer = io.StringIO()
    header = list(found[0]) if found else ["trial", "outcome", *table.keys, table.metric]
    writer = csv.DictWriter(buffer, fieldnames=header, lineterminator="\n")
    writer.writeheader()
    writer.writerows({k: "" if v is None else v for k, v in r.items()} for r in found)
    return buffer.getvalue()


def _entry(table: Table, trial: TrialResult | None) -> dict[str, Any] | None:
    if trial is None:
        return None
    m, cost = table.metric, trial.cost
    return {
        "trial": trial.name, "run": trial.layout.run, "values": dict(trial.values),
        "outcome": trial.outcome_text, m: trial.final, f"best_{m}": trial.best,
        f"best_{m}_epoch": trial.best_epoch, "unit": cost.unit if cost else None,
        "hours_held": cost.held_h if cost else None, f"{m}_per_hour": table.per_hour(trial),
        **trial.files(),
    }  # fmt: skip


def best_doc(table: Table) -> dict[str, Any]:
    """``best.json``: the best trial by the metric and by the metric per allocated hour."""
    return {
        "sweep": table.sweep, "metric": table.metric, "direction": table.direction,
        "trials": table.counts, "best": _entry(table, table.best()),
        "best_per_hour": _entry(table, table.best_per_hour()),
    }  # fmt: skip


def write(table: Table, csv_path: Path, best_path: Path) -> None:
    """Write the table (CSV) and the best trial (JSON), each atomically."""
    atomic.write_text(csv_path, csv_text(table))
    atomic.write_text(best_path, json.dumps(best_doc(table), indent=1) + "\n")


def _shown(table: Table, value: float | None) -> str:
    if value is None:
        return "-"
    return f"{100 * value:.2f} %" if table.metric == "accuracy" else f"{value:.4g}"


def top_cells(table: Table, top: int = TOP) -> list[tuple[str, ...]]:
    """The header and the ``top`` first trials' cells: rank (``-``: not ranked), trial,
    outcome, metric, best (epoch), hours held, goodput, images/s."""
    m = table.metric
    cells = [("#", "trial", "outcome", m, "best (epoch)", "hours held", "goodput", "images/s")]
    for i, t in enumerate(table.trials[:top], 1):
        held = f"{t.cost.held_h:.4f} {t.cost.unit}" if t.cost else "-"
        best = f"{_shown(table, t.best)} ({t.best_epoch})" if t.best is not None else "-"
        speed = f"{t.images_per_s:,.0f}" if t.images_per_s is not None else "-"
        good = f"{t.cost.goodput:.0%}" if t.cost and t.cost.goodput is not None else "-"
        outcome = t.outcome_text if len(t.outcome_text) <= 40 else t.outcome_text[:37] + "..."
        cells.append((str(i) if t.ranked else "-", t.name, outcome, _shown(table, t.final), best,
                      held, good, speed))  # fmt: skip
    return cells


def heading(table: Table) -> str:
    """``sweep lr: 8 trial(s): 6 completed, 1 pruned, 1 failed, 0 running, 0 pending``."""
    counts = ", ".join(f"{n} {o}" for o, n in table.counts.items())
    return f"sweep {table.sweep}: {len(table.trials)} trial(s): {counts}"


def text(table: Table, top: int = TOP) -> str:
    """The top trials as a short aligned table, the counts, the best trial and the causes of
    the failed ones (what every snakemake call prints)."""
    cells = top_cells(table, top)
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    lines = [f"{heading(table)} ({table.layout.trials_csv})",
             *("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
               for r in cells)]  # fmt: skip
    if len(table.trials) > top:
        lines.append(f"  ... {len(table.trials) - top} more in {table.layout.trials_csv}")
    m, best = table.metric, table.best()
    if best is not None:
        where = best.files()["model"] or best.layout.root
        lines.append(f"  best: {best.name} ({m} {_shown(table, best.final)}): {where}")
    cheap = table.best_per_hour()
    if cheap is not None and best is not None and cheap is not best and cheap.cost is not None:
        lines.append(f"  best per {cheap.cost.unit}-hour: {cheap.name} ({m} "
                     f"{_shown(table, cheap.final)} in {cheap.cost.held_h:.4f} h)")  # fmt: skip
    failed = [t for t in table.trials if t.outcome == FAILED]
    lines.extend(f"  failed: {t.name}: {t.detail}" for t in failed[:top])
    return "\n".join(lines)
