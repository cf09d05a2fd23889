"""The run summary printed after every snakemake call and by `ddppipe summary`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import yaml

from ddppipe.core import jsonl


def make_run(root: Path, slurm: bool = False) -> Path:
    """A finished run's files: two epochs, two slots (a time limit, then completed); with
    ``slurm``, the slots of SLURM job 17 (submitted 50 s before the first slot started)."""
    run = root / "results" / "mine"
    (run / "export").mkdir(parents=True)
    (run / "export" / "model.pt").write_bytes(b"weights")
    cfg = {
        "run": "mine",
        "task": "tasks/mine.py",
        "script": None,
        "task_source": {"sha256": "ab" * 32},
        "scaling": {"accuracy_targets": [0.9, 0.99]},
    }
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    jsonl.write(run / "train" / "metrics.jsonl", [
        {"epoch": 1, "test_accuracy": 0.91, "test_loss": 0.3, "images_per_s": 1000.0,
         "world_size": 4, "time": 1_000_100.0},
        {"epoch": 2, "test_accuracy": 0.95, "test_loss": 0.2, "images_per_s": 3000.0,
         "world_size": 4, "time": 1_000_300.0},
    ])  # fmt: skip
    attempts = [
        {"outcome": "time limit", "start": 1_000_000.0, "end": 1_000_200.0},
        {"outcome": "completed", "start": 1_000_250.0, "end": 1_000_400.0},
    ]
    if slurm:
        attempts[0].update(job="17", submitted=999_950.0, queue_s=48.0)
        attempts[1].update(job="17", submitted=1_000_205.0, queue_s=44.0)
    (run / "train" / "attempts.json").write_text(json.dumps(attempts))
    return run


def test_summary_of_a_finished_run(tmp_path: Path) -> None:
    make_run(tmp_path)
    result = subprocess.run(
        [sys.executable, "-m", "ddppipe", "summary", "mine"], cwd=tmp_path, capture_output=True,
        text=True, check=True,
    )  # fmt: skip
    assert result.stdout.splitlines() == [
        "run mine: task tasks/mine.py (sha256 abababababab)",
        "  accuracy  95.00 % after epoch 2 (best 95.00 %, epoch 2); test loss 0.2000",
        "  targets   90.00 %: epoch 1, 100.0 s after the first slot's start; 99.00 %: not reached",
        "  speed     2,000 images/s (median of 2 epoch(s), 4 processes)",
        "  attempts  2 slot(s): 1 time limit, 1 completed",
        "  wall      6.7 min from the first slot's start to the last slot's end",
        "  results   results/mine/export/model.pt",
    ]


def test_summary_of_a_slurm_run_counts_from_its_first_submission(tmp_path: Path) -> None:
    """Times from the submission the first slot recorded; without slurmdbd (none runs here:
    no SLURM_CONF), the summary says that its figures are its own."""
    make_run(tmp_path, slurm=True)
    result = subprocess.run(
        [sys.executable, "-m", "ddppipe", "summary", "mine"], cwd=tmp_path, capture_output=True,
        text=True, check=True, env={k: v for k, v in os.environ.items() if k != "SLURM_CONF"},
    )  # fmt: skip
    lines = result.stdout.splitlines()
    assert (
        "  targets   90.00 %: epoch 1, 2.5 min after the first submission; 99.00 %: not "
        "reached" in lines
    ), lines
    assert "  sacct     no SLURM accounting: own measurements" in lines, lines
    assert "  wall      7.5 min from the first submission to the last slot's end" in lines, lines


def test_summary_of_an_unknown_run_says_so(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ddppipe", "summary", "nothere"], cwd=tmp_path,
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert "results/nothere: no such run" in result.stderr


class _Cells(HTMLParser):
    """The text of a page's heading and table cells, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.cells: list[str] = []
        self._open = False

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag in ("h3", "th", "td"):
            self.cells.append("")
            self._open = True

    def handle_endtag(self, tag: str) -> None:
        self._open = self._open and tag not in ("h3", "th", "td")

    def handle_data(self, data: str) -> None:
        if self._open:
            self.cells[-1] += data


def test_summary_as_html_escapes_and_keeps_every_line(tmp_path: Path) -> None:
    """`--html`: the fragment the report opens on; a task name is text, not markup."""
    run = make_run(tmp_path)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["task"] = "tasks/<b>&mine.py"
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    result = subprocess.run(
        [sys.executable, "-m", "ddppipe", "summary", "mine", "--html", "out/summary.html"],
        cwd=tmp_path, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert result.stdout == ""
    page = (tmp_path / "out" / "summary.html").read_text()
    assert "<b>" not in page and page.isascii()
    parser = _Cells()
    parser.feed(page)
    assert parser.cells == [
        "run mine: task tasks/<b>&mine.py (sha256 abababababab)",
        "accuracy", "95.00 % after epoch 2 (best 95.00 %, epoch 2); test loss 0.2000",
        "targets", "90.00 %: epoch 1, 100.0 s after the first slot's start; 99.00 %: not reached",
        "speed", "2,000 images/s (median of 2 epoch(s), 4 processes)",
        "attempts", "2 slot(s): 1 time limit, 1 completed",
        "wall", "6.7 min from the first slot's start to the last slot's end",
        "results", "results/mine/export/model.pt",
    ]  # fmt: skip


def test_summary_of_a_script_warns_of_a_nan_it_logged(tmp_path: Path) -> None:
    """A script's job.log of a NaN loss (from step 30 on) ends in a warning line."""
    from ddppipe.reports import summary

    run = tmp_path / "results" / "mine"
    (run / "train").mkdir(parents=True)
    cfg = {"run": "mine", "task": None, "script": "train.py", "task_source": {}}
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    jsonl.write(run / "train" / "metrics.jsonl", [
        {"step": 20, "loss": 0.5, "time": 1.0}, {"step": 30, "loss": float("nan"), "time": 2.0},
        {"step": 40, "loss": float("nan"), "time": 3.0},
    ])  # fmt: skip
    assert summary.build(run).lines == [
        ("logged", "step 40, loss nan"),
        ("warning", "non-finite loss logged from step 30 on (job.log)"),
    ]
