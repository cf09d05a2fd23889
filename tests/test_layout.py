"""A run's layout and kind (ddppipe.settings.layout): every path of a run, spelled out."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddppipe.runstate.state import StateDir
from ddppipe.settings import layout
from ddppipe.settings.layout import RunLayout


def test_the_paths_of_a_named_run() -> None:
    run = RunLayout("mnist")
    assert str(run.root) == "results/mnist"
    assert str(run.config) == "results/mnist/config.yaml"
    assert str(run.state) == "results/mnist/state"
    assert str(run.tensorboard) == "results/mnist/tensorboard"
    assert str(run.summary) == "results/mnist/summary.html"


def test_the_training_files() -> None:
    train = RunLayout("mnist").train
    assert str(train.root) == "results/mnist/train"
    assert str(train.final_checkpoint) == "results/mnist/train/final.pt"
    assert str(train.weights) == "results/mnist/train/model.pt"
    assert str(train.record) == "results/mnist/train/final.json"
    assert str(train.evaluation) == "results/mnist/train/evaluation.json"
    assert str(train.outputs) == "results/mnist/train/outputs"
    assert str(train.metrics) == "results/mnist/train/metrics.jsonl"
    assert str(train.attempts) == "results/mnist/train/attempts.json"
    assert str(train.attempts_html) == "results/mnist/train/attempts.html"
    assert str(train.curves) == "results/mnist/train/training_curves.png"
    assert str(train.result("task")) == "results/mnist/train/final.pt"
    assert str(train.result("script")) == "results/mnist/train/outputs"


def test_the_evaluation_and_export_files() -> None:
    run = RunLayout("mnist")
    assert str(run.eval.metrics) == "results/mnist/eval/metrics.json"
    assert str(run.eval.plot("task")) == "results/mnist/eval/confusion_matrix.png"
    assert str(run.eval.plot("script")) == "results/mnist/eval/metrics.png"
    assert str(run.export.weights) == "results/mnist/export/model.pt"
    assert str(run.export.outputs) == "results/mnist/export/outputs"
    assert str(run.export.provenance) == "results/mnist/export/provenance.json"
    assert str(run.export.result("task")) == "results/mnist/export/model.pt"
    assert str(run.export.result("script")) == "results/mnist/export/outputs"


def test_logs_and_benchmarks_of_a_rule() -> None:
    run = RunLayout("mnist")
    assert str(run.log("train")) == "logs/mnist/train.log"
    assert str(run.log("write_config")) == "logs/mnist/write_config.log"
    assert str(run.benchmark("train")) == "benchmarks/mnist/train.tsv"
    other = RunLayout("r", results=Path("/x/res"), logs=Path("/x/lg"), benchmarks=Path("/x/b"))
    assert str(other.config) == "/x/res/r/config.yaml"
    assert str(other.log("export")) == "/x/lg/r/export.log"
    assert str(other.benchmark("export")) == "/x/b/r/export.tsv"


def test_the_wildcard_layout_gives_the_rules_patterns() -> None:
    run = RunLayout("{run}")
    assert str(run.train.metrics) == "results/{run}/train/metrics.jsonl"
    assert str(run.log("evaluate")) == "logs/{run}/evaluate.log"
    assert str(run.state) == "results/{run}/state"


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("task", [
            "results/m/eval/metrics.json", "results/m/eval/confusion_matrix.png",
            "results/m/train/training_curves.png", "results/m/train/attempts.html",
            "results/m/export/model.pt", "results/m/export/provenance.json",
            "results/m/summary.html",
        ]),
        ("script", [
            "results/m/eval/metrics.json", "results/m/eval/metrics.png",
            "results/m/train/training_curves.png", "results/m/train/attempts.html",
            "results/m/export/outputs", "results/m/export/provenance.json",
            "results/m/summary.html",
        ]),
    ],
)  # fmt: skip
def test_the_targets_of_rule_all(kind: layout.RunKind, expected: list[str]) -> None:
    assert [str(p) for p in RunLayout("m").targets(kind)] == expected


def test_of_root_reads_the_run_name_and_results_folder() -> None:
    run = RunLayout.of_root("/data/results/digits")
    assert run.run == "digits"
    assert str(run.results) == "/data/results"
    assert str(run.train.metrics) == "/data/results/digits/train/metrics.jsonl"
    assert RunLayout.of_root(Path("results/mnist")) == RunLayout("mnist")
    trial = RunLayout.of_root("/data/results/sweeps/lr/lr=0.01")  # a sweep's trial
    assert (trial.run, str(trial.results)) == ("sweeps/lr/lr=0.01", "/data/results")
    assert str(trial.log("train")) == "logs/sweeps/lr/lr=0.01/train.log"


def test_the_state_folder_files_under_the_layouts_state_root() -> None:
    folder = StateDir(RunLayout("mnist").state)
    assert str(folder.mlflow_run_id) == "results/mnist/state/mlflow_run_id"
    assert str(folder.excluded_nodes) == "results/mnist/state/excluded-nodes.json"
    assert str(folder.metrics) == "results/mnist/state/metrics.jsonl"
    assert str(folder.checkpoints) == "results/mnist/state/checkpoints"
    assert str(folder.tensorboard) == "results/mnist/tensorboard"
    assert str(StateDir(Path("/tmp/t/state")).tensorboard) == "/tmp/t/tensorboard"


@pytest.mark.parametrize(
    ("cfg", "expected"),
    [
        ({"script": "examples/scripts/train_ddp.py", "task": "ddppipe.tasks.mnist"}, "script"),
        ({"script": None, "task": "ddppipe.tasks.mnist"}, "task"),
        ({"script": "", "task": "ddppipe.tasks.mnist"}, "task"),
        ({"task": "ddppipe.tasks.mnist"}, "task"),
    ],
)
def test_the_run_kind(cfg: dict[str, object], expected: str) -> None:
    assert layout.kind(cfg) == expected


def test_the_layout_is_frozen() -> None:
    run = RunLayout("mnist")
    with pytest.raises(AttributeError):
        run.run = "other"  # type: ignore[misc]
