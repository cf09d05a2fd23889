"""A run's layout and kind: where every file of a run lives, and whether it trains a task or a
script. The one place that knows both.

``results/<run>/`` holds the run's resolved config, its state folder (what survives failed,
preempted and requeued jobs: :mod:`ddppipe.runstate.state` knows the files inside it), the
training's outputs (``train/``), the evaluation (``eval/``), the published result and its
provenance (``export/``), the TensorBoard event files and the summary; ``logs/<run>/`` and
``benchmarks/<run>/`` hold its rules' logs and benchmarks.

The rules build the layout of the ``{run}`` wildcard (``RunLayout("{run}")``: every path a
pattern), the rest of ddppipe that of a named run. Only the standard library: any layer may
use it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

RunKind = Literal["task", "script"]

RESULTS = Path("results")
SWEEPS = "sweeps"  # results/sweeps/<sweep>/: a sweep's table, figures and trials
LOGS = Path("logs")
BENCHMARKS = Path("benchmarks")
# Tasks whose task_args and model() passed write_config's check, by what the check depends on
# (ddppipe.launching.resolve): a sweep's trials with the same task_args check it once.
TASK_CHECKS = Path("resources/task-checks")


def kind(cfg: Mapping[str, Any]) -> RunKind:
    """What the run trains: a task (model and data, :mod:`ddppipe.tasks`, prepared by the data
    rule) or a torchrun script (config key ``script``), launched by the same machinery."""
    return "script" if cfg.get("script") else "task"


@dataclass(frozen=True)
class TrainFiles:
    """``results/<run>/train/``: what the training leaves when it completes."""

    root: Path

    @property
    def final_checkpoint(self) -> Path:
        """A task's final checkpoint."""
        return self.root / "final.pt"

    @property
    def weights(self) -> Path:
        """A task's final weights alone (what export publishes, without loading torch)."""
        return self.root / "model.pt"

    @property
    def record(self) -> Path:
        """The final checkpoint's epochs, config hash and meta as JSON (for the provenance)."""
        return self.root / "final.json"

    @property
    def evaluation(self) -> Path:
        """A task's final model's test-set evaluation (distributed, on the training's ranks)."""
        return self.root / "evaluation.json"

    @property
    def outputs(self) -> Path:
        """A script's output files (job.output_dir()), published when it completes."""
        return self.root / "outputs"

    @property
    def metrics(self) -> Path:
        """Metrics (JSON lines): per epoch, or per job.log call of a script."""
        return self.root / "metrics.jsonl"

    @property
    def attempts(self) -> Path:
        """Every job slot that trained the run."""
        return self.root / "attempts.json"

    @property
    def attempts_html(self) -> Path:
        return self.root / "attempts.html"

    @property
    def curves(self) -> Path:
        return self.root / "training_curves.png"

    def result(self, run_kind: RunKind) -> Path:
        """What the training leaves: a task's final checkpoint, a script's output folder."""
        return self.outputs if run_kind == "script" else self.final_checkpoint


@dataclass(frozen=True)
class EvalFiles:
    """``results/<run>/eval/``: the final model's metrics (a script's last logged values)."""

    root: Path

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.json"

    def plot(self, run_kind: RunKind) -> Path:
        """A task's confusion matrix, a script's last logged values."""
        return self.root / ("metrics.png" if run_kind == "script" else "confusion_matrix.png")


@dataclass(frozen=True)
class ExportFiles:
    """``results/<run>/export/``: the published result and its provenance."""

    root: Path

    @property
    def weights(self) -> Path:
        return self.root / "model.pt"

    @property
    def outputs(self) -> Path:
        return self.root / "outputs"

    @property
    def provenance(self) -> Path:
        return self.root / "provenance.json"

    def result(self, run_kind: RunKind) -> Path:
        """A task's final weights, a script's output folder."""
        return self.outputs if run_kind == "script" else self.weights


@dataclass(frozen=True)
class RunLayout:
    """Every path of the run ``run``: results under ``results``, logs under ``logs``,
    benchmarks under ``benchmarks`` (all relative to the workflow's working directory)."""

    run: str
    results: Path = RESULTS
    logs: Path = LOGS
    benchmarks: Path = BENCHMARKS

    @classmethod
    def of_root(cls, root: str | Path) -> RunLayout:
        """The layout of the run whose results folder is ``root`` (``<results>/<run>``, a
        sweep's trial ``<results>/sweeps/<sweep>/<trial>``); its logs and benchmarks in the
        default folders."""
        root = Path(root)
        if root.parent.parent.name == SWEEPS:
            return cls(f"{SWEEPS}/{root.parent.name}/{root.name}", root.parents[2])
        return cls(root.name, root.parent)

    @property
    def root(self) -> Path:
        """``results/<run>``."""
        return Path(self.results) / self.run

    @property
    def config(self) -> Path:
        """The run's resolved config (rule write_config): what every later step reads."""
        return self.root / "config.yaml"

    @property
    def state(self) -> Path:
        """The state folder's root; :class:`ddppipe.runstate.state.StateDir` gives its files."""
        return self.root / "state"

    @property
    def train(self) -> TrainFiles:
        return TrainFiles(self.root / "train")

    @property
    def eval(self) -> EvalFiles:
        return EvalFiles(self.root / "eval")

    @property
    def export(self) -> ExportFiles:
        return ExportFiles(self.root / "export")

    @property
    def tensorboard(self) -> Path:
        """TensorBoard event files of every slot (next to the state folder, for users)."""
        return self.root / "tensorboard"

    @property
    def wandb(self) -> Path:
        """Weights & Biases' files of every slot: one ``offline-run-*`` folder each, one run."""
        return self.root / "wandb"

    @property
    def summary(self) -> Path:
        """The run's summary as HTML (rule summarize)."""
        return self.root / "summary.html"

    def log(self, step: str) -> Path:
        """The log of the rule ``step`` for this run (``logs/<run>/<step>.log``)."""
        return Path(self.logs) / self.run / f"{step}.log"

    def benchmark(self, step: str) -> Path:
        """The benchmark of the rule ``step`` for this run (``benchmarks/<run>/<step>.tsv``)."""
        return Path(self.benchmarks) / self.run / f"{step}.tsv"

    def targets(self, run_kind: RunKind) -> list[Path]:
        """The run's final files: what ``snakemake`` (rule all) builds for it."""
        return [
            self.eval.metrics,
            self.eval.plot(run_kind),
            self.train.curves,
            self.train.attempts_html,
            self.export.result(run_kind),
            self.export.provenance,
            self.summary,
        ]


@dataclass(frozen=True)
class SweepLayout:
    """``results/sweeps/<sweep>/``: the sweep's table, best trial, figures, its Optuna journal
    and definition; each trial is the run ``sweeps/<sweep>/<trial>`` (its folder is here too)."""

    name: str
    results: Path = RESULTS

    @property
    def root(self) -> Path:
        return Path(self.results) / SWEEPS / self.name

    @property
    def pack(self) -> Path:
        """A packed sweep's queue of trials and its allocations' records
        (:mod:`ddppipe.packing.pool`)."""
        return self.root / "pack"

    @property
    def trials_csv(self) -> Path:
        """One row per trial: outcome, values, metric, cost."""
        return self.root / "trials.csv"

    @property
    def best(self) -> Path:
        """The best trial by the metric, and by the metric per allocated hour."""
        return self.root / "best.json"

    @property
    def figures(self) -> Path:
        return self.root / "figures"

    @property
    def metric_vs_parameters(self) -> Path:
        """The metric against each parameter, one panel a parameter."""
        return self.figures / "metric_vs_parameters.png"

    @property
    def learning_curves(self) -> Path:
        """Every trial's metric per epoch, on one plot."""
        return self.figures / "learning_curves.png"

    @property
    def parallel_coordinates(self) -> Path:
        """Every trial as a line through its values and its metric."""
        return self.figures / "parallel_coordinates.png"

    @property
    def overview(self) -> Path:
        """The top trials and the figures as an HTML fragment: the report's first screen."""
        return self.figures / "overview.html"

    @property
    def journal(self) -> Path:
        """Optuna's journal (file storage, no database server): reports, pruning, suggestions."""
        return self.root / "optuna.journal"

    @property
    def definition(self) -> Path:
        """The sweep's keys and method when it first ran: a name is never reused for another."""
        return self.root / "sweep.json"

    @property
    def mlflow_lock(self) -> Path:
        """Held while a trial finds or creates the sweep's MLflow parent run."""
        return self.root / ".mlflow-parent.lock"

    @property
    def rounds(self) -> Path:
        """A model-based method's rounds of suggested trials (``<k>.json``)."""
        return self.root / "rounds"

    def trial(self, trial: str) -> RunLayout:
        """The run layout of the trial named ``trial``."""
        return RunLayout(f"{SWEEPS}/{self.name}/{trial}", self.results)
