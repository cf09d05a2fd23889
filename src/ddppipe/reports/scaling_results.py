"""The scaling study's numbers: throughput, scaling efficiency and time to accuracy per trial."""

from __future__ import annotations

import csv
import html
import io
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ddppipe.core import atomic, jsonl


@dataclass(frozen=True)
class RunResult:
    """One trial of the study: its launch settings and per-epoch training history."""

    trial: str  # the trial's name, e.g. nnodes=1+nproc_per_node=2+cpus_per_proc=1
    nodes: int
    procs_per_node: int
    cpus_per_proc: int
    history: list[dict[str, Any]]

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    @property
    def order(self) -> tuple[int, int, int]:
        return self.nodes, self.procs_per_node, self.cpus_per_proc

    @classmethod
    def of(cls, cfg: dict[str, Any], history: list[dict[str, Any]]) -> RunResult:
        """The result of the trial whose resolved config is ``cfg``."""
        launch = cfg["launch"]
        trial = (cfg.get("trial") or {}).get("name") or cfg["run"]
        return cls(trial, launch["nnodes"], launch["nproc_per_node"],
                   launch["cpus_per_proc"] or 0, history)  # fmt: skip

    @property
    def images_per_s(self) -> float:
        """Median training throughput over the epochs (all ranks together)."""
        return statistics.median(m["images_per_s"] for m in self.history)

    def time_to_accuracy(self, target: float) -> float | None:
        """Seconds of training and evaluation until the test accuracy first reached ``target``."""
        elapsed = 0.0
        for m in self.history:
            elapsed += m["epoch_seconds"]
            if m["test_accuracy"] >= target:
                return elapsed
        return None


def read_history(path: Path) -> list[dict[str, Any]]:
    """Per-epoch metrics from a metrics JSON-lines file."""
    return jsonl.read(path)


def load(metrics: Sequence[Path], configs: Sequence[Path]) -> list[RunResult]:
    """Results of the runs whose metrics and resolved configs are given pairwise."""
    if len(metrics) != len(configs):
        raise ValueError(f"{len(metrics)} metrics files but {len(configs)} configs")
    results = []
    for metrics_path, config_path in zip(metrics, configs, strict=True):
        cfg = yaml.safe_load(Path(config_path).read_text())
        results.append(RunResult.of(cfg, read_history(metrics_path)))
    return sorted(results, key=lambda r: r.order)


def efficiency(result: RunResult, results: Sequence[RunResult]) -> float | None:
    """images/s / (world size x images/s of the one-process run with the same CPUs per task)."""
    single = [r for r in results if r.world_size == 1 and r.cpus_per_proc == result.cpus_per_proc]
    if not single:
        return None
    return result.images_per_s / (result.world_size * single[0].images_per_s)


def target_column(target: float) -> str:
    return f"seconds_to_{100 * target:g}pct"


def table(results: Sequence[RunResult], targets: Sequence[float]) -> list[dict[str, Any]]:
    """One row per trial: its layout, throughput, efficiency and times to accuracy."""
    rows = []
    for r in results:
        last = r.history[-1]
        eff = efficiency(r, results)
        row: dict[str, Any] = {
            "trial": r.trial,
            "nodes": r.nodes,
            "procs_per_node": r.procs_per_node,
            "cpus_per_proc": r.cpus_per_proc,
            "world_size": r.world_size,
            "epochs": last["epoch"],
            "images_per_s": round(r.images_per_s, 1),
            "scaling_efficiency": None if eff is None else round(eff, 3),
            "final_test_accuracy": round(last["test_accuracy"], 4),
            "total_seconds": round(sum(m["epoch_seconds"] for m in r.history), 1),
        }
        for target in targets:
            seconds = r.time_to_accuracy(target)
            row[target_column(target)] = None if seconds is None else round(seconds, 1)
        rows.append(row)
    return rows


def write_csv(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """The table as CSV; a target never reached is an empty cell."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    atomic.write_text(path, out.getvalue())


HEADERS = {
    "trial": "trial",
    "nodes": "nodes",
    "procs_per_node": "processes / node",
    "cpus_per_proc": "CPUs / process",
    "world_size": "world size",
    "epochs": "epochs",
    "images_per_s": "training images/s",
    "scaling_efficiency": "scaling efficiency",
    "final_test_accuracy": "final test accuracy",
    "total_seconds": "train + eval time (s)",
}


def _header(column: str) -> str:
    if column.startswith("seconds_to_"):
        return f"time to {column[len('seconds_to_') : -3]} % test accuracy (s)"
    return HEADERS.get(column, column)


def _cell(column: str, value: Any) -> str:
    if value is None:
        return "not reached" if column.startswith("seconds_to_") else "n/a"
    if column == "final_test_accuracy":
        return f"{100 * value:.2f} %"
    return str(value)


def write_html(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """The table as a small self-contained HTML page."""
    columns = list(rows[0])
    head = "".join(f"<th>{html.escape(_header(c))}</th>" for c in columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_cell(c, row[c]))}</td>" for c in columns) + "</tr>"
        for row in rows
    )
    page = (
        '<!DOCTYPE html>\n<html><head><meta charset="utf-8">'
        "<title>Scaling study: time to accuracy</title><style>"
        "body{font-family:sans-serif}table{border-collapse:collapse}"
        "th,td{border:1px solid #bbb;padding:4px 8px;text-align:right}th{background:#eee}"
        "</style></head><body><h3>Scaling study: throughput and time to accuracy</h3>"
        "<p>Times are training plus per-epoch evaluation, without process start-up. "
        "Scaling efficiency = images/s / (world size &times; images/s of one process with "
        "the same CPUs per process).</p>"
        f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></body></html>\n"
    )
    atomic.write_text(path, page)
