"""The scaling study, a grid sweep over the launch keys: its trials and their configs, its
numbers, its DAG, and a real tiny study."""

from __future__ import annotations

import base64
import csv
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from bench.screenshot import chromium, open_report
from ddppipe.core import jsonl
from ddppipe.reports import scaling_results
from ddppipe.reports.scaling_results import RunResult
from ddppipe.settings import config
from ddppipe.settings.runs import Runs
from tests.conftest import run_cli
from tests.documented_build import Build
from tests.tiny import default_config
from tests.workflow_helpers import job_counts, snakemake

STUDY = "results/sweeps/scaling"  # the study's figures and table; its trials in folders below


def trial(nodes: int, procs: int, cpus: int) -> str:
    """The run of the study's trial with these launch settings, as a user finds it on disk."""
    return f"sweeps/scaling/nnodes={nodes}+nproc_per_node={procs}+cpus_per_proc={cpus}"


def study_config(**scaling_section: Any) -> dict[str, Any]:
    cfg = default_config()
    cfg["scaling"] = {
        "nodes": [1],
        "procs_per_node": [1, 2],
        "cpus_per_proc": [1],
        "epochs": 3,
        **scaling_section,
    }
    return cfg


# -- the study's trials and their configs --------------------------------------------------
def test_trials_are_the_grid_of_the_three_lists_sorted() -> None:
    runs = Runs(study_config(nodes=[2, 1], procs_per_node=[2, 1], cpus_per_proc=[4]))
    assert runs.scaling_runs() == [trial(1, 1, 4), trial(1, 2, 4), trial(2, 1, 4), trial(2, 2, 4)]
    assert runs.names() == ["mnist", *runs.scaling_runs()]
    sizes = [config.world_size(config.resolve(runs.config(r), False)) for r in runs.scaling_runs()]
    assert sizes == [1, 2, 2, 4]


def test_trial_config_sets_launch_and_epochs_and_names_the_trial() -> None:
    cfg = study_config(cpus_per_proc=[1, 4])
    cfg["slurm"] = {"mem_mb": 4000}
    runs = Runs(cfg)
    assert runs.config(trial(1, 2, 4))["slurm"] == {"mem_mb": 4000}
    run_cfg = runs.config(trial(1, 2, 1))
    assert run_cfg["run"] == "sweeps/scaling/nnodes=1+nproc_per_node=2+cpus_per_proc=1"
    assert run_cfg["launch"] == {
        **cfg["launch"],
        "nnodes": 1,
        "nproc_per_node": 2,
        "cpus_per_proc": 1,
    }
    assert run_cfg["train"] == {**cfg["train"], "epochs": 3}
    assert run_cfg["task_args"] == cfg["task_args"]
    assert run_cfg["trial"] == {  # as any sweep's trial: its provenance names the study
        "sweep": "scaling",
        "name": "nnodes=1+nproc_per_node=2+cpus_per_proc=1",
        "values": {"launch.nnodes": 1, "launch.nproc_per_node": 2, "launch.cpus_per_proc": 1},
        "prune": None,
    }
    assert "scaling" not in run_cfg and "sweep" not in run_cfg
    assert cfg["scaling"]["epochs"] == 3 and cfg["run"] == "mnist"  # the base is untouched
    resolved = config.resolve(run_cfg, gpus=False)
    assert config.world_size(resolved) == 2 and resolved["train"]["epochs"] == 3


def test_every_trial_trains_the_same_recipe() -> None:
    """Same global batch and hashed recipe in every trial: only the layout changes."""
    runs = Runs(study_config(procs_per_node=[1, 2], cpus_per_proc=[1, 2]))
    resolved = [config.resolve(runs.config(run), gpus=False) for run in runs.scaling_runs()]
    assert len({config.train_hash(r, "0123456789abcdef") for r in resolved}) == 1
    assert {(r["launch"]["nproc_per_node"], r["launch"]["cpus_per_proc"]) for r in resolved} == {
        (1, 1),
        (1, 2),
        (2, 1),
        (2, 2),
    }


def test_null_study_epochs_keep_the_train_epochs() -> None:
    cfg = study_config(epochs=None)
    cfg["train"]["epochs"] = 5
    assert Runs(cfg).config(trial(1, 1, 1))["train"]["epochs"] == 5


def test_base_run_config_is_the_config_without_the_study() -> None:
    cfg = study_config()
    assert Runs(cfg).config("mnist") == {k: v for k, v in cfg.items() if k != "scaling"}


@pytest.mark.parametrize(
    "run", [trial(1, 4, 1), "other", "scaling-n1-p2-c1", "sweeps/scaling/nnodes=1"]
)
def test_unknown_run_is_a_clear_error(run: str) -> None:
    with pytest.raises(config.ConfigError, match=f"unknown run '{re.escape(run)}'.*mnist"):
        Runs(study_config()).config(run)


def test_a_sweep_beside_the_study_keeps_its_own_trials() -> None:
    """The user's sweep and the study: two sweeps, each its own folder, no run in both."""
    cfg = study_config()
    cfg["sweep"] = config.validate(default_config())["sweep"] | {
        "name": "lr", "parameters": {"train.lr": [0.01, 0.1]}
    }  # fmt: skip
    runs = Runs(cfg)
    assert runs.names() == [
        "mnist", trial(1, 1, 1), trial(1, 2, 1), "sweeps/lr/lr=0.01", "sweeps/lr/lr=0.1"
    ]  # fmt: skip
    assert runs.config(trial(1, 2, 1))["train"]["lr"] == cfg["train"]["lr"]
    assert runs.config("sweeps/lr/lr=0.1")["launch"] == cfg["launch"]


def test_a_sweep_named_scaling_is_a_clear_error() -> None:
    cfg = study_config()
    cfg["sweep"] = config.validate(default_config())["sweep"] | {
        "name": "scaling", "parameters": {"train.lr": [0.01, 0.1]}
    }  # fmt: skip
    with pytest.raises(
        config.ConfigError, match=r"sweep.name: 'scaling' is the scaling study's sweep .* another"
    ):
        Runs(cfg)


def test_schema_fills_the_study_defaults() -> None:
    cfg = default_config()
    del cfg["scaling"]
    study = config.validate(cfg)["scaling"]
    assert study["nodes"] == [1] and study["epochs"] == 2
    bad = study_config(procs_per_node=[0])
    with pytest.raises(config.ConfigError, match=r"scaling\.procs_per_node"):
        config.validate(bad)


# -- the study's numbers -------------------------------------------------------------------
def history(accuracies: list[float], images_per_s: float, seconds: float = 10.0) -> list[dict]:
    return [
        {
            "epoch": i + 1,
            "test_accuracy": a,
            "test_loss": 1 - a,
            "epoch_seconds": seconds,
            "images_per_s": images_per_s,
        }
        for i, a in enumerate(accuracies)
    ]


def result(nodes: int, procs: int, cpus: int, history: list[dict]) -> RunResult:
    name = f"nnodes={nodes}+nproc_per_node={procs}+cpus_per_proc={cpus}"
    return RunResult(name, nodes, procs, cpus, history)


def test_result_of_a_trials_config() -> None:
    cfg = Runs(study_config(cpus_per_proc=[3])).config(trial(1, 2, 3))
    assert RunResult.of(config.resolve(cfg, gpus=False), []) == result(1, 2, 3, [])


def test_time_to_accuracy_counts_epochs_until_the_target() -> None:
    r = result(1, 1, 1, history([0.97, 0.985, 0.991], 100.0))
    assert r.time_to_accuracy(0.98) == 20.0
    assert r.time_to_accuracy(0.99) == 30.0
    assert r.time_to_accuracy(0.995) is None


def test_efficiency_is_relative_to_one_process_with_the_same_cpus() -> None:
    one = result(1, 1, 1, history([0.9], 100.0))
    two = result(1, 2, 1, history([0.9], 150.0))
    lonely = result(1, 2, 2, history([0.9], 300.0))
    results = [one, two, lonely]
    assert scaling_results.efficiency(one, results) == 1.0
    assert scaling_results.efficiency(two, results) == 0.75
    assert scaling_results.efficiency(lonely, results) is None


def test_table_csv_and_html(tmp_path: Path) -> None:
    results = [
        result(1, 1, 1, history([0.97, 0.99], 100.0)),
        result(1, 2, 1, history([0.96, 0.98], 180.0, seconds=6.0)),
    ]
    rows = scaling_results.table(results, [0.98, 0.99])
    scaling_results.write_csv(rows, tmp_path / "t.csv")
    scaling_results.write_html(rows, tmp_path / "t.html")
    read = list(csv.DictReader((tmp_path / "t.csv").open()))
    assert [r["trial"] for r in read] == [
        "nnodes=1+nproc_per_node=1+cpus_per_proc=1",
        "nnodes=1+nproc_per_node=2+cpus_per_proc=1",
    ]
    assert read[1]["scaling_efficiency"] == "0.9"
    assert (read[0]["seconds_to_98pct"], read[0]["seconds_to_99pct"]) == ("20.0", "20.0")
    assert (read[1]["seconds_to_98pct"], read[1]["seconds_to_99pct"]) == ("12.0", "")
    page = (tmp_path / "t.html").read_text()
    assert "time to 99 % test accuracy (s)" in page and "not reached" in page
    assert "nnodes=1+nproc_per_node=2+cpus_per_proc=1" in page


# -- the workflow --------------------------------------------------------------------------
def test_dry_run_has_one_training_per_trial_and_one_plot(tmp_path: Path) -> None:
    cfg = study_config(procs_per_node=[1, 2], cpus_per_proc=[1, 2])
    counts = job_counts(tmp_path, cfg, "scaling")
    assert counts["train"] == 4
    assert counts["plot_scaling"] == 1
    assert counts["export"] == 4  # each trial's provenance
    assert counts["summarize"] == 4  # and summary (the report's first screen)
    assert counts["write_config"] == 4  # the 4 trials; the dataset needs no run's config
    assert counts["scaling"] == 1
    assert "evaluate" not in counts


def test_each_trial_requests_its_own_nodes_and_cpus(tmp_path: Path) -> None:
    """The train jobs' SLURM resources and local threads (processes x CPUs) follow the trial."""
    cfg = study_config(nodes=[1, 2], procs_per_node=[1, 2], cpus_per_proc=[3])
    out = snakemake(tmp_path, cfg, "-n", "--cores", "8", "scaling").stdout
    jobs = {}
    for block in out.split("rule train:")[1:]:
        run = re.search(r"wildcards: run=(\S+)", block)[1]
        jobs[run] = dict(re.findall(r"\b(nodes|tasks|cpus_per_task|mpi)=(\w+)", block))
        jobs[run]["threads"] = (re.search(r"threads: (\d+)", block) or [0, "1"])[1]

    def job(nodes: int, cpus: int) -> dict[str, str]:
        return {"nodes": str(nodes), "tasks": str(nodes), "cpus_per_task": str(cpus), "mpi": "0",
                "threads": str(cpus)}  # fmt: skip

    assert jobs == {
        trial(1, 1, 3): job(1, 3),
        trial(1, 2, 3): job(1, 6),
        trial(2, 1, 3): job(2, 3),
        trial(2, 2, 3): job(2, 6),
    }


def test_unknown_run_target_fails_in_the_dry_run(tmp_path: Path) -> None:
    result = snakemake(
        tmp_path, study_config(), "-n", f"results/{trial(1, 8, 1)}/config.yaml", check=False
    )
    assert result.returncode != 0
    assert f"unknown run '{trial(1, 8, 1)}'" in result.stdout + result.stderr


def _data_uri_payload(page: str, path: Path) -> bool:
    return base64.b64encode(path.read_bytes()).decode() in page


@pytest.fixture(scope="module")
def tiny_study(shared_build: Build) -> tuple[Path, dict]:
    """The base run and a study of world sizes 1 and 2 (2 epochs each, targets 50 % and
    99.9 %), for real, on tiny data; then the report: `snakemake --cores all scaling` and
    `snakemake --report report.html all scaling` of docs/training.md in the shared build."""
    return shared_build.checkout, shared_build.config(shared_build.checkout)


@pytest.mark.slow
def test_tiny_study_outputs(tiny_study: tuple[Path, dict]) -> None:
    workdir, _ = tiny_study
    out = workdir / STUDY
    for name in ["learning_curves.png", "throughput.png"]:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    rows = list(csv.DictReader((out / "time_to_accuracy.csv").open()))
    assert [(r["world_size"], r["epochs"]) for r in rows] == [("1", "2"), ("2", "2")]
    assert rows[0]["scaling_efficiency"] == "1.0"
    assert float(rows[1]["images_per_s"]) > 0
    assert [r["trial"] for r in rows] == [
        "nnodes=1+nproc_per_node=1+cpus_per_proc=1",
        "nnodes=1+nproc_per_node=2+cpus_per_proc=1",
    ]
    for run, world in [(trial(1, 1, 1), 1), (trial(1, 2, 1), 2)]:
        run_cfg = yaml.safe_load((workdir / "results" / run / "config.yaml").read_text())
        assert run_cfg["launch"]["cpus_per_proc"] == 1
        provenance = json.loads(
            (workdir / "results" / run / "export" / "provenance.json").read_text()
        )
        assert provenance["training"]["world_size"] == world
    history = [
        json.loads(x)
        for x in (workdir / "results" / trial(1, 2, 1) / "train" / "metrics.jsonl")
        .read_text()
        .splitlines()
    ]
    assert [m["world_size"] for m in history] == [2, 2]


@pytest.mark.slow
def test_report_embeds_plots_metrics_and_provenance(tiny_study: tuple[Path, dict]) -> None:
    workdir, cfg = tiny_study
    page = (workdir / "report.html").read_text()
    results = workdir / "results"
    embedded = [
        workdir / STUDY / "learning_curves.png",
        workdir / STUDY / "throughput.png",
        workdir / STUDY / "time_to_accuracy.csv",
        workdir / STUDY / "time_to_accuracy.html",
        results / cfg["run"] / "train" / "training_curves.png",
        results / cfg["run"] / "eval" / "confusion_matrix.png",
        results / cfg["run"] / "eval" / "metrics.json",
        results / cfg["run"] / "export" / "provenance.json",
        results / trial(1, 1, 1) / "export" / "provenance.json",
        results / trial(1, 2, 1) / "export" / "provenance.json",
    ]
    for path in embedded:
        assert path.name in page, path
        assert _data_uri_payload(page, path), f"{path} is not embedded in the report"
    for caption in ["Scaling study: test loss", "scaling efficiency", "Provenance of run"]:
        assert caption in page, caption


def _png_size(path: Path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    return int.from_bytes(header[16:20], "big"), int.from_bytes(header[20:24], "big")


def _show_figure(driver: Any, category: str, path: str) -> tuple[int, int]:
    """Open ``path`` from the report's menu (its category, then its eye button) as a user
    would; the natural size of the image the page then shows, once loaded."""
    for back in driver.find_elements(By.XPATH, "//nav//a[normalize-space()='Results']"):
        back.click()  # from a category's list back to the categories
    driver.find_element(By.XPATH, f"//nav//a[normalize-space()='{category}']").click()
    row = driver.find_element(By.XPATH, f"//nav//tr[td[normalize-space()='{path}']]")
    row.find_element(By.CSS_SELECTOR, "a[iconname='eye']").click()
    payload = base64.b64encode(Path(path).read_bytes()).decode()
    shown = "return [...document.images].filter(i => i.src.includes(arguments[0]) && i.complete)"
    img = WebDriverWait(driver, 10).until(lambda d: d.execute_script(shown, payload))[0]
    return img.get_property("naturalWidth"), img.get_property("naturalHeight")


@pytest.mark.slow
def test_report_opens_offline_on_the_runs_summary(
    tiny_study: tuple[Path, dict], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """In headless Chromium with its network off: the first screen is the main run's summary,
    line for line as `ddppipe summary` prints it; the figures open from the menu and render."""
    workdir, cfg = tiny_study
    run = cfg["run"]
    printed = run_cli("summary", run, cwd=workdir).stdout.splitlines()
    monkeypatch.chdir(workdir)  # the menu lists results by their path in the workdir
    driver = chromium(1400, 900)
    try:
        open_report(driver, workdir / "report.html")
        assert driver.save_screenshot(str(tmp_path / "first.png"))
        assert _png_size(tmp_path / "first.png") == (1400, 900)
        sections = driver.find_elements(By.CSS_SELECTOR, ".ddppipe-summary")
        assert [s.get_attribute("data-run") for s in sections] == [
            run, trial(1, 1, 1), trial(1, 2, 1)
        ]  # fmt: skip
        main = sections[0]
        assert main.is_displayed()
        top, bottom, height = driver.execute_script(
            "const r = arguments[0].getBoundingClientRect();"
            " return [r.top, r.bottom, window.innerHeight]",
            main,
        )
        assert 0 <= top < bottom <= height, "the summary is not all on the first screen"
        assert main.find_element(By.TAG_NAME, "h3").text == printed[0]
        rows = [
            (tr.find_element(By.TAG_NAME, "th").text, tr.find_element(By.TAG_NAME, "td").text)
            for tr in main.find_elements(By.TAG_NAME, "tr")
        ]
        assert rows == [tuple(line.split(None, 1)) for line in printed[1:]]
        final = jsonl.read(workdir / "results" / run / "train" / "metrics.jsonl")[-1]
        shown = float(dict(rows)["accuracy"].split(" %")[0])
        assert shown == pytest.approx(100 * final["test_accuracy"], abs=0.005)
        warnings = main.find_elements(By.CSS_SELECTOR, "tr.waste")
        assert len(warnings) == [label for label, _ in rows].count("waste")
        assert not driver.find_elements(By.CSS_SELECTOR, ".system-message")  # docutils errors
        for category, path in [
            ("Training", f"results/{run}/train/training_curves.png"),
            ("Evaluation", f"results/{run}/eval/confusion_matrix.png"),
            ("Scaling study", f"{STUDY}/learning_curves.png"),
            ("Scaling study", f"{STUDY}/throughput.png"),
        ]:
            assert _show_figure(driver, category, path) == _png_size(Path(path)), path
        loaded = driver.execute_script(
            "return performance.getEntriesByType('resource').map(e => e.name)"
        )
        assert [url for url in loaded if not url.startswith(("data:", "file:"))] == []
    finally:
        driver.quit()
