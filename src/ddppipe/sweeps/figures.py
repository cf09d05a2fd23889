"""A sweep's figures (PNG, matplotlib's Agg backend) and the report's first screen.

- the metric against each parameter (one panel a parameter; completed trials as dots, pruned
  ones as grey crosses, the best as a star);
- every trial's learning curve (the metric per epoch) on one plot;
- a parallel-coordinates view: each trial a line through its values and its metric, coloured
  by the metric;
- ``overview.html``: the counts, the top trials and the three figures (embedded), the first
  screen of ``snakemake --report`` when the config has a sweep.
"""

from __future__ import annotations

import base64
import html
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.ticker import MaxNLocator

from ddppipe.core import atomic
from ddppipe.reports import plots
from ddppipe.sweeps.table import heading, top_cells
from ddppipe.sweeps.trials import FAILED, PRUNED, Table, TrialResult, metric_value

plt = plots.plt
TOP = 10  # trials in the overview's table
LEGEND_MAX = 12  # trials named in the learning curves' legend


def _numeric(values: Sequence[Any]) -> bool:
    return all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)


def _log(values: Sequence[Any]) -> bool:
    """A log axis for numbers that are all positive and span a factor of 20 or more."""
    return bool(values) and _numeric(values) and min(values) > 0 and max(values) / min(values) >= 20


def _positions(values: Sequence[Any]) -> tuple[list[float], list[str] | None]:
    """Where each value goes on its axis, and the tick labels of a categorical one."""
    if _numeric(values):
        return [float(v) for v in values], None
    labels = sorted({str(v) for v in values})
    return [float(labels.index(str(v))) for v in values], labels


def metric_vs_parameters(table: Table, path: Path) -> None:
    """The final metric of each trial that has one against each swept key."""
    shown = [t for t in table.trials if t.final is not None]
    best = table.best()
    fig, axes = plt.subplots(1, len(table.keys), figsize=(4.2 * len(table.keys), 3.6),
                             squeeze=False, sharey=True)  # fmt: skip
    for ax, key in zip(axes[0], table.keys, strict=True):
        x, labels = _positions([t.values[key] for t in shown])
        for xi, t in zip(x, shown, strict=True):
            pruned = t.outcome == PRUNED
            ax.scatter(xi, t.final, marker="x" if pruned else "o", color="grey" if pruned else "C0",
                       zorder=2)  # fmt: skip
            if t is best:
                ax.scatter(xi, t.final, marker="*", s=220, color="C3", zorder=3, label="best")
        if labels is not None:
            ax.set_xticks(range(len(labels)), labels, rotation=30)
        elif _log([t.values[key] for t in shown]):
            ax.set_xscale("log")
        ax.set_xlabel(key)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"{table.metric} (final)")
    if best is not None:
        axes[0][0].legend(loc="best")
    fig.suptitle(f"sweep {table.sweep}: {table.metric} against each parameter "
                 "(crosses: pruned)")  # fmt: skip
    plots.save(fig, path)


def _curve(table: Table, trial: TrialResult) -> tuple[list[float], list[float]]:
    points = [(r.get("epoch", r.get("step")), metric_value(r, table.metric)) for r in trial.history]
    kept = [(x, y) for x, y in points if x is not None and y is not None]
    return [x for x, _ in kept], [y for _, y in kept]


def learning_curves(table: Table, path: Path) -> None:
    """Every trial's metric per epoch: pruned trials dashed, failed ones dotted."""
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    styles = {PRUNED: "--", FAILED: ":"}
    named = len(table.trials) <= LEGEND_MAX
    for i, trial in enumerate(table.trials):
        x, y = _curve(table, trial)
        if x:
            ax.plot(x, y, styles.get(trial.outcome, "-"), marker="." if len(x) < 30 else None,
                    color=f"C{i % 10}", label=trial.name if named else None)  # fmt: skip
    ax.set_xlabel("epoch")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(f"test {table.metric}")
    ax.set_title(f"sweep {table.sweep}: learning curves (dashed: pruned, dotted: failed)")
    ax.grid(alpha=0.3)
    if named and ax.lines:
        ax.legend(fontsize=8, loc="best")
    plots.save(fig, path)


def parallel_coordinates(table: Table, path: Path) -> None:
    """Each trial with a metric as a line through its values (each axis scaled to its range,
    a log axis where the values span a factor of 20) and its metric, coloured by the metric."""
    shown = [t for t in table.trials if t.final is not None]
    axes_names = [*table.keys, table.metric]
    fig, ax = plt.subplots(figsize=(max(6.0, 2.2 * len(axes_names)), 4.5))
    columns: list[list[float]] = []
    ticks: list[list[tuple[float, str]]] = []  # each axis's (height, label)
    for key in axes_names:
        values = [t.final if key == table.metric else t.values[key] for t in shown]
        x, labels = _positions(values)
        if labels is None and _log(values):
            x = [math.log10(v) for v in x]
        low, high = (min(x), max(x)) if x else (0.0, 1.0)
        span = (high - low) or 1.0
        columns.append([(v - low) / span for v in x])
        if labels is not None:
            ticks.append([((i - low) / span, label) for i, label in enumerate(labels)])
        elif values:
            ticks.append([(0.0, f"{min(values):.3g}"), (1.0, f"{max(values):.3g}")])
        else:
            ticks.append([])
    finals = [t.final or 0.0 for t in shown]
    low, high = (min(finals), max(finals)) if finals else (0.0, 1.0)
    cmap = plt.get_cmap("viridis")
    for j, trial in enumerate(shown):
        shade = ((trial.final or 0.0) - low) / ((high - low) or 1.0)
        pruned = trial.outcome == PRUNED
        ax.plot(range(len(axes_names)), [column[j] for column in columns],
                "--" if pruned else "-", alpha=0.8,
                color="grey" if pruned else cmap(shade))  # fmt: skip
    for i, marks in enumerate(ticks):
        ax.axvline(i, color="black", linewidth=0.8)
        for height, label in marks:
            ax.text(i + 0.03, height, label, ha="left", va="center", fontsize=8)
    ax.set_xticks(range(len(axes_names)), axes_names)
    ax.set_yticks([])
    ax.set_ylim(-0.15, 1.15)
    ax.set_title(f"sweep {table.sweep}: parallel coordinates (colour: {table.metric}; dashed: "
                 "pruned)", pad=18)  # fmt: skip
    plots.save(fig, path)


def _image(path: Path, title: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    title = html.escape(title)
    return (f'<figure><img src="data:image/png;base64,{data}" alt="{title}" '
            f'style="max-width:100%"><figcaption>{title}</figcaption></figure>')  # fmt: skip


_STYLE = (  # scoped to the fragment: it sits inside the report's page
    ".ddppipe-sweep table{margin:0;font-size:inherit;border-collapse:collapse}"
    ".ddppipe-sweep th,.ddppipe-sweep td{padding:2px 6px;text-align:left;vertical-align:top}"
    ".ddppipe-sweep th{white-space:nowrap}"
    ".ddppipe-sweep img{max-width:100%}.ddppipe-sweep figcaption{font-size:small}"
)


def overview(table: Table, figures: dict[Path, str], path: Path) -> None:
    """The counts, the best trial, the top trials (as printed after a snakemake call) and the
    figures as one HTML fragment: the report's first screen (the whole table: trials.csv)."""
    cells = top_cells(table, TOP)
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cells[0])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
                   for row in cells[1:])  # fmt: skip
    best = table.best()
    best_line = (f"<p>best: <b>{html.escape(best.name)}</b>: "
                 f"{html.escape(str(best.files()['model'] or best.layout.root))}</p>"
                 if best is not None else "")  # fmt: skip
    more = len(table.trials) - TOP
    rest = f"<p>{more} more in {html.escape(str(table.layout.trials_csv))}</p>" if more > 0 else ""
    page = (
        f'<section class="ddppipe-sweep" data-sweep="{html.escape(table.sweep)}">'
        f"<style>{_STYLE}</style><h3>{html.escape(heading(table))}</h3>{best_line}"
        f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>{rest}"
        + "".join(_image(p, title) for p, title in figures.items())
        + "</section>\n"
    )
    atomic.write_text(path, page.encode("ascii", "xmlcharrefreplace").decode())


def write(table: Table, out_dir: Path | None = None) -> list[Path]:
    """The three figures and the overview into ``out_dir`` (default: the sweep's figures
    folder); the paths written."""
    where = table.layout
    folder = Path(out_dir) if out_dir is not None else where.figures
    made = {
        folder / where.metric_vs_parameters.name: f"{table.metric} against each parameter",
        folder / where.learning_curves.name: "learning curves of every trial",
        folder / where.parallel_coordinates.name: "parallel coordinates",
    }
    drawers = (metric_vs_parameters, learning_curves, parallel_coordinates)
    for draw, target in zip(drawers, made, strict=True):
        draw(table, target)
    overview(table, made, folder / where.overview.name)
    return [*made, folder / where.overview.name]
