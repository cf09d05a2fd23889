"""A sweep's results: trials.csv, best.json, the figures, the TensorBoard HParams view, the
top trials printed after a snakemake call, and the report's first screen.

No training: each trial's run folder holds the files a real trial leaves (the formats of a
real digits sweep: resolved config, metrics.jsonl, attempts.json, evaluation; written by
bench/sweep_table.py, which times the same table for 1,000 trials). Five trials of
``train.lr``, every way a trial ends: two completed, one pruned at epoch 1, one crashed, one
not run yet. Every epoch ends 10 s after the one before, the SLURM slot (2 CPUs) started
30 s after its submission and ended 6 s after its last epoch.
"""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import sweep_table as trials
from ddppipe.runstate.state import StateDir
from ddppipe.settings import layout, sweep
from ddppipe.sweeps import trials as sweep_trials
from tests.tiny import REPO
from tests.workflow_helpers import snakemake

LRS = [0.001, 0.01, 0.03, 0.1, 0.3, 1.0]
CAUSE = "rank 0 on c1: RuntimeError: boom at task.py:9 (in loss), step 12 (epoch 2)"
# The log of a write_config whose task refused its task_args (a real one's lines).
REFUSED = (
    "ddppipe resolve-config: error: task ddppipe.tasks.digits (digits.py): invalid "
    "configuration:\n  task_args.width: 0 is less than the minimum of 1\ntask_args belong to "
    "the task: after changing task:, give the new task its own\n"
)
WHY = ("write_config: task ddppipe.tasks.digits (digits.py): invalid configuration: "
       "task_args.width: 0 is less than the minimum of 1 "
       "(logs/sweeps/lr/lr=1.0/write_config.log)")  # fmt: skip
SWEEP = {"name": "lr", "parameters": {"train.lr": LRS}}
CONFIG = {"run": "digits", "task": "ddppipe.tasks.digits",
          "train": {"preset": "fast", "epochs": 3, "batch_size": 64},
          "launch": {"nproc_per_node": 1, "cpus_per_proc": 2}, "sweep": SWEEP}  # fmt: skip


def build(root: Path, ends: dict[str, Any]) -> Path:
    """The sweep ``lr`` under ``root/results``: each trial named in ``ends`` as a list of
    accuracies (completed), ("pruned", accuracies), ("crashed", accuracies) or ("refused",)
    (its write_config failed); the others not run. Its sweep.json, as rule sweep_trials
    writes it."""
    cfg = trials.base_config(SWEEP)
    found = sweep.from_config(cfg)
    assert found is not None
    resolved = trials.resolved_trial(cfg, found, sweep.trials(found)[0])
    for trial in sweep.trials(found):
        run = layout.RunLayout(trial.run, root / "results")
        end = ends.get(trial.name)
        if end is None:
            continue
        if end[0] == "refused":
            log = root / layout.RunLayout(trial.run).log("write_config")
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_text(REFUSED)
            continue
        trials.write_config(run, resolved, found, trial)
        if isinstance(end, list):
            trials.completed(run, end)
        elif end[0] == "pruned":
            trials.completed(run, end[1], pruned_at=len(end[1]))
        else:
            trials.crashed(run, end[1], CAUSE)
    path = root / "results" / "sweeps" / "lr" / "sweep.json"
    trials.write_json(path, sweep_trials.document(found))
    return path


ENDS = {
    "lr=0.01": [0.6, 0.985],
    "lr=0.03": [0.7, 0.95, 0.99],
    "lr=0.1": ("pruned", [0.3]),
    "lr=0.3": ("crashed", [0.2]),
    "lr=1.0": ("refused",),
}


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The five trials, then `ddppipe sweep-table` and `ddppipe plot-sweep` as the rules run
    them, in one process that says whether it imported torch; (root, what it printed)."""
    root = tmp_path_factory.mktemp("sweep")
    build(root, ENDS)
    folder = "results/sweeps/lr"
    code = (
        "import sys; from ddppipe.cli.main import main\n"
        f"assert main(['sweep-table', '--sweep', '{folder}/sweep.json', '--csv', "
        f"'{folder}/trials.csv', '--best', '{folder}/best.json']) == 0\n"
        f"assert main(['plot-sweep', '--sweep', '{folder}/sweep.json', '--out-dir', "
        f"'{folder}/figures']) == 0\n"
        "print('torch imported:', 'torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                          text=True, timeout=120, check=True)  # fmt: skip
    return root, done.stdout


HEADER = ["trial", "outcome", "train.lr", "accuracy", "best_accuracy", "best_accuracy_epoch",
          "epochs", "time_to_98pct_s", "time_to_99pct_s", "images_per_s", "unit", "units",
          "hours_held", "hours_training", "queue_s", "goodput"]  # fmt: skip


def test_trials_csv_one_row_per_trial_best_first(made: tuple[Path, str]) -> None:
    root, _ = made
    with (root / "results/sweeps/lr/trials.csv").open() as f:
        found = list(csv.reader(f))
    assert found[0] == HEADER
    # 0.03: 98 % and 99 % at epoch 3, 60 s after the submission (30 s queued + 3 epochs);
    # hours: 2 CPUs x (30 s + 6 s) held, 2 x 24 s training; images/s: the epochs' median;
    # goodput: 24 s of its 36 s trained kept steps (its one slot checkpointed them all).
    assert found[1:] == [
        ["lr=0.03", "completed", "0.03", "0.99", "0.99", "3", "3", "60.0", "60.0", "2000.0",
         "CPU", "2", "0.02", "0.013333", "30.0", "0.6667"],
        ["lr=0.01", "completed", "0.01", "0.985", "0.985", "2", "2", "50.0", "", "1500.0",
         "CPU", "2", "0.014444", "0.008889", "30.0", "0.6154"],
        ["lr=0.1", "pruned at epoch 1", "0.1", "0.3", "0.3", "1", "1", "", "", "1000.0",
         "CPU", "2", "0.008889", "0.004444", "30.0", "0.5"],
        ["lr=0.3", f"failed: crashed (exit 1): {CAUSE}", "0.3", "", "0.2", "1", "1", "", "",
         "1000.0", "", "", "", "", "", ""],
        ["lr=1.0", f"failed: {WHY}", "1.0", "", "", "", "0", "", "", "", "", "", "", "", "",
         ""],
        ["lr=0.001", "pending", "0.001", "", "", "", "0", "", "", "", "", "", "", "", "",
         ""],
    ]  # fmt: skip


def test_best_json_by_metric_and_per_hour(made: tuple[Path, str]) -> None:
    root, _ = made
    best = json.loads((root / "results/sweeps/lr/best.json").read_text())
    folder = "results/sweeps/lr"
    assert best["sweep"] == "lr" and best["metric"] == "accuracy"
    assert best["trials"] == {"completed": 2, "pruned": 1, "failed": 2, "running": 0,
                              "pending": 1}  # fmt: skip
    top = best["best"]
    assert (top["trial"], top["run"], top["values"]) == ("lr=0.03", "sweeps/lr/lr=0.03",
                                                          {"train.lr": 0.03})  # fmt: skip
    assert top["accuracy"] == 0.99 and top["best_accuracy_epoch"] == 3
    assert top["model"] == f"{folder}/lr=0.03/export/model.pt"
    assert top["provenance"] == f"{folder}/lr=0.03/export/provenance.json"
    assert top["hours_held"] == pytest.approx(0.02)
    # 0.985 in 0.0144 CPU-hours beats 0.99 in 0.02.
    cheap = best["best_per_hour"]
    assert cheap["trial"] == "lr=0.01"
    assert cheap["accuracy_per_hour"] == pytest.approx(0.985 / (2 * 26 / 3600))


def test_printed_top_trials(made: tuple[Path, str]) -> None:
    _, printed = made
    assert printed.splitlines() == [
        "sweep lr: 6 trial(s): 2 completed, 1 pruned, 2 failed, 0 running, 1 pending "
        "(results/sweeps/lr/trials.csv)",
        "  #  trial    outcome                                   accuracy  best (epoch)  "
        "hours held  goodput  images/s",
        "  1  lr=0.03  completed                                 99.00 %   99.00 % (3)   "
        "0.0200 CPU  67%      2,000",
        "  2  lr=0.01  completed                                 98.50 %   98.50 % (2)   "
        "0.0144 CPU  62%      1,500",
        "  3  lr=0.1   pruned at epoch 1                         30.00 %   30.00 % (1)   "
        "0.0089 CPU  50%      1,000",
        "  -  lr=0.3   failed: crashed (exit 1): rank 0 on c...  -         20.00 % (1)   "
        "-           -        1,000",
        "  -  lr=1.0   failed: write_config: task ddppipe.ta...  -         -             "
        "-           -        -",
        "  ... 1 more in results/sweeps/lr/trials.csv",
        "  best: lr=0.03 (accuracy 99.00 %): results/sweeps/lr/lr=0.03/export/model.pt",
        "  best per CPU-hour: lr=0.01 (accuracy 98.50 % in 0.0144 h)",
        f"  failed: lr=0.3: crashed (exit 1): {CAUSE}",
        f"  failed: lr=1.0: {WHY}",
        "torch imported: False",
    ]


def test_minimize_ranks_lowest_first(made: tuple[Path, str]) -> None:
    root, _ = made
    doc = json.loads((root / "results/sweeps/lr/sweep.json").read_text())
    doc.update(metric="loss", direction="minimize")
    found = sweep_trials.collect(doc, root / "results")
    assert [(t.name, t.final) for t in found.trials[:3]] == [
        ("lr=0.03", pytest.approx(0.01)), ("lr=0.01", pytest.approx(0.015)),
        ("lr=0.1", pytest.approx(0.7)),
    ]  # fmt: skip
    assert [t.best_epoch for t in found.trials[:4]] == [3, 2, 1, 1]  # the lowest test loss


def test_tensorboard_hparams_view(made: tuple[Path, str]) -> None:
    """TensorBoard's own loader finds the experiment and one session a trial that ran, each
    with its values, outcome, status and final figures."""
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer
    from tensorboard.plugins.hparams import api_pb2, metadata

    root, _ = made
    loaded = EventMultiplexer()
    loaded.AddRunsFromDirectory(str(root / "results/sweeps/lr"))
    loaded.Reload()
    found = loaded.PluginRunToTagToContent(metadata.PLUGIN_NAME)
    assert set(found) == {".", "lr=0.01", "lr=0.03", "lr=0.1", "lr=0.3", "lr=1.0"}  # not pending
    experiment = metadata.parse_experiment_plugin_data(found["."][metadata.EXPERIMENT_TAG])
    assert [h.name for h in experiment.hparam_infos] == ["train.lr", "outcome"]
    lr = experiment.hparam_infos[0]
    assert lr.type == api_pb2.DATA_TYPE_FLOAT64
    assert [v.number_value for v in lr.domain_discrete.values] == LRS
    assert [m.name.tag for m in experiment.metric_infos] == [
        "sweep/accuracy", "sweep/best_accuracy", "sweep/epochs", "sweep/images_per_s",
        "sweep/hours_held", "sweep/hours_training", "sweep/goodput"]  # fmt: skip
    expected = {"lr=0.03": (0.03, "completed", api_pb2.STATUS_SUCCESS),
                "lr=0.1": (0.1, "pruned", api_pb2.STATUS_SUCCESS),
                "lr=0.3": (0.3, "failed", api_pb2.STATUS_FAILURE)}  # fmt: skip
    for run, (lr, outcome, status) in expected.items():
        start = metadata.parse_session_start_info_plugin_data(
            found[run][metadata.SESSION_START_INFO_TAG]
        )
        assert start.hparams["train.lr"].number_value == lr
        assert start.hparams["outcome"].string_value == outcome
        end = metadata.parse_session_end_info_plugin_data(found[run][metadata.SESSION_END_INFO_TAG])
        assert end.status == status
    final = loaded.Scalars("lr=0.03", "sweep/accuracy")
    assert [(e.step, round(e.value, 6)) for e in final] == [(3, 0.99)]
    assert loaded.Scalars("lr=0.03", "sweep/hours_held")[0].value == pytest.approx(0.02)
    assert loaded.Scalars("lr=0.03", "sweep/goodput")[0].value == pytest.approx(24 / 36)
    assert "sweep/accuracy" not in loaded.GetAccumulator("lr=0.3").Tags()["scalars"]


def test_figures_and_overview(made: tuple[Path, str]) -> None:
    root, _ = made
    figures = layout.SweepLayout("lr", root / "results")
    for png in (figures.metric_vs_parameters, figures.learning_curves,
                figures.parallel_coordinates):  # fmt: skip
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    page = figures.overview.read_text()
    assert page.startswith('<section class="ddppipe-sweep" data-sweep="lr">')
    assert "<h3>sweep lr: 6 trial(s): 2 completed, 1 pruned, 2 failed, 0 running, 1 pending" in page
    assert "<td>lr=0.03</td><td>completed</td><td>99.00 %</td>" in page
    assert page.count("data:image/png;base64,") == 3


def test_rewritten_unchanged_keeps_the_hparams_files(
    made: tuple[Path, str], tmp_path: Path
) -> None:
    root, _ = made
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    before = sorted(p.name for p in copy.rglob("events.out.tfevents.*"))
    from ddppipe.sweeps import results

    results.save(sweep_trials.load(copy / "results/sweeps/lr/sweep.json"))
    assert sorted(p.name for p in copy.rglob("events.out.tfevents.*")) == before
    assert len(before) == 6  # the experiment, every trial but the pending one


def test_every_snakemake_call_prints_and_writes_the_table(
    made: tuple[Path, str], tmp_path: Path
) -> None:
    """The end of a snakemake call that did not run rule sweep_table (a trial failed, one
    never ran) still writes trials.csv with the failed trial's cause, and prints the top."""
    root, _ = made
    work = tmp_path / "work"
    shutil.copytree(root, work)
    (work / "results/sweeps/lr/trials.csv").unlink()
    (work / "results/sweeps/lr/sweep.json").unlink()
    done = snakemake(work, CONFIG, "--cores", "1", "results/sweeps/lr/sweep.json")
    printed = done.stderr
    assert "sweep lr: 6 trial(s): 2 completed, 1 pruned, 2 failed, 0 running, 1 pending" in printed
    assert f"  failed: lr=0.3: crashed (exit 1): {CAUSE}" in printed
    with (work / "results/sweeps/lr/trials.csv").open() as f:
        outcomes = {r["trial"]: r["outcome"] for r in csv.DictReader(f)}
    assert outcomes["lr=0.3"] == f"failed: crashed (exit 1): {CAUSE}"
    assert outcomes["lr=1.0"] == f"failed: {WHY}"
    assert outcomes["lr=0.001"] == "pending"


def _report_files(run: layout.RunLayout) -> None:
    """What a completed trial's report items are, as files (the rules' figures and pages)."""
    png = (REPO / "docs" / "report-first-screen.png").read_bytes()
    for path in (run.eval.plot("task"), run.train.curves):
        path.write_bytes(png)
    run.train.attempts_html.write_text("<html><body>attempts</body></html>\n")
    run.summary.write_text('<section class="ddppipe-summary" data-run="x"></section>\n')


def test_report_opens_on_the_sweep(tmp_path: Path) -> None:
    """`snakemake --report report.html sweep`: the sweep's overview (its top trials and
    figures) comes before every run's summary on the report's first page."""
    ends = {"lr=0.01": [0.6, 0.985], "lr=0.03": [0.7, 0.95, 0.99]}
    two = {"name": "lr", "parameters": {"train.lr": [0.01, 0.03]}}
    cfg = {**CONFIG, "sweep": two}
    found = sweep.from_config(trials.base_config(two))
    assert found is not None
    resolved = trials.resolved_trial(trials.base_config(two), found, sweep.trials(found)[0])
    for trial in sweep.trials(found):
        run = layout.RunLayout(trial.run, tmp_path / "results")
        trials.write_config(run, resolved, found, trial)
        trials.completed(run, ends[trial.name])
        _report_files(run)
    sweep_json = tmp_path / "results/sweeps/lr/sweep.json"
    trials.write_json(sweep_json, sweep_trials.document(found))
    from ddppipe.sweeps import figures, results

    made = sweep_trials.load(sweep_json)
    results.save(made)
    figures.write(made)
    snakemake(tmp_path, cfg, "--report", "report.html", "sweep")
    page = (tmp_path / "report.html").read_text()  # the landing page: a JavaScript string
    overview, summary = (
        r"<section class=\"ddppipe-sweep\" data-sweep=\"lr\">",
        r"class=\"ddppipe-summary\"",
    )
    assert page.count(overview) == 1
    assert page.index(overview) < page.index(summary)


@pytest.mark.slow  # MLflow's import and its sqlite store: 3 s on the idle 2-core machine
def test_mlflow_trials_are_children_of_one_parent_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three trials whose slots start at once (one thread each, as three ranks 0 would) agree
    on one parent run for the sweep; a local sqlite:/// store."""
    from mlflow.tracking import MlflowClient

    from ddppipe.settings.run_spec import RunSpec
    from ddppipe.training.tracking import mlflow_log, run_tracking

    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment(mlflow_log.DEFAULT_EXPERIMENT)  # the store, made once
    cfg = trials.base_config(SWEEP)
    found = sweep.from_config(cfg)
    assert found is not None
    names = ["lr=0.01", "lr=0.03", "lr=0.1"]
    trackers = []
    for trial in sweep.trials(found):
        if trial.name in names:
            spec = RunSpec.from_config({**trials.resolved_trial(cfg, found, trial),
                                        "task_source": trials.TASK_SOURCE})  # fmt: skip
            state = StateDir(layout.RunLayout(trial.run, tmp_path / "results").state)
            parent = mlflow_log.SweepParent.of(spec, state)
            assert parent == mlflow_log.SweepParent(
                "lr", tmp_path / "results/sweeps/lr/.mlflow-parent.lock"
            )
            trackers.append(run_tracking.Tracker(None, state, mlflow_uri=uri, run_name=trial.run,
                                             parent=parent))  # fmt: skip
    for i, tracker in enumerate(trackers):
        tracker.log(10, {"accuracy": 0.5 + i / 10}, prefix="test")
    for tracker in trackers:
        tracker.close()
    runs = client.search_runs([experiment])
    (top,) = [r for r in runs if r.data.tags.get(mlflow_log.ROLE_TAG) == "sweep"]
    assert (top.info.run_name, top.data.tags[mlflow_log.SWEEP_TAG]) == ("sweep lr", "lr")
    children = {r.info.run_name: r for r in runs if r is not top}
    assert sorted(children) == [f"sweeps/lr/{n}" for n in names]
    for child in children.values():
        assert child.data.tags[mlflow_log.PARENT_TAG] == top.info.run_id
        assert child.data.tags[mlflow_log.SWEEP_TAG] == "lr"
        assert child.info.status == "FINISHED"
    assert children["sweeps/lr/lr=0.1"].data.metrics["test/accuracy"] == pytest.approx(0.7)
