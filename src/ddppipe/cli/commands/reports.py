"""The report subcommands: evaluation files and figures, training curves, the scaling study's
figures and table, a run's summary.

Imports are inside each command: only ``evaluate`` loads torch.
"""

from __future__ import annotations

import json
from pathlib import Path


def evaluate(
    checkpoint: Path, data: Path, metrics: Path, plot: Path, config_path: Path,
    batch_size: int | None,
) -> int:  # fmt: skip
    """``ddppipe evaluate``: evaluate a checkpoint on the test set; its metrics JSON and plot."""
    from ddppipe.core import atomic
    from ddppipe.reports import plots
    from ddppipe.settings import run_spec
    from ddppipe.training.loop import evaluate

    spec = run_spec.load(config_path)
    batch_size = batch_size or spec.train.eval_batch_size
    result = evaluate.evaluate_checkpoint(checkpoint, spec, data, batch_size)
    atomic.write_json(metrics, result)
    plots.evaluation(result, plot)
    return 0


def plot_evaluation(evaluation: Path, metrics: Path, plot: Path) -> int:
    """``ddppipe plot-evaluation``: the training's final evaluation as metrics JSON and figure."""
    from ddppipe.core import atomic
    from ddppipe.reports import plots

    result = json.loads(evaluation.read_text())
    atomic.write_json(metrics, result)
    plots.evaluation(result, plot)
    return 0


def evaluate_logged(metrics: Path, out: Path, plot: Path) -> int:
    """``ddppipe evaluate-logged``: a script run's last logged values, as JSON and a plot."""
    from ddppipe.core import atomic, jsonl
    from ddppipe.reports import plots

    history = jsonl.read(metrics)
    result: dict[str, object] = {"points": len(history)}
    for record in history:  # the last value of every key the script logged
        result.update({k: v for k, v in record.items() if k != "time"})
    atomic.write_json(out, result)
    plots.evaluation({k: v for k, v in result.items() if k not in ("step", "points")},
                     plot, "last logged values")  # fmt: skip
    return 0


def plot_training(metrics: Path, out: Path) -> int:
    """``ddppipe plot-training``: per-epoch loss and accuracy from ``metrics`` (JSON lines)."""
    from ddppipe.core import jsonl
    from ddppipe.reports import plots

    history = jsonl.read(metrics)
    plots.training_curves(history, out)
    return 0


def plot_scaling(
    metrics: list[Path], configs: list[Path], targets: list[float], curves: Path,
    throughput: Path, table_csv: Path, table_html: Path,
) -> int:  # fmt: skip
    """``ddppipe plot-scaling``: the scaling study's figures and time-to-accuracy table."""
    from ddppipe.reports import scaling_plots, scaling_results

    results = scaling_results.load(metrics, configs)
    scaling_plots.learning_curves(results, curves)
    scaling_plots.throughput(results, throughput)
    rows = scaling_results.table(results, targets)
    scaling_results.write_csv(rows, table_csv)
    scaling_results.write_html(rows, table_html)
    return 0


def summary(run: str, results: Path, html: Path | None) -> int:
    """``ddppipe summary``: a run's summary, printed or (``html``) as the report's fragment."""
    from ddppipe.reports import summary

    run_dir = results / run
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir}: no such run (its results folder is missing)")
    if html:
        from ddppipe.reports import summary_html

        summary_html.write(summary.build(run_dir), html)
    else:
        print(summary.text(run_dir))
    return 0
