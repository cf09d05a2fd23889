"""The Snakemake DAG: its shape for the default config, and real end-to-end runs."""

import json
import re
from pathlib import Path

import pytest
import torch

from ddppipe.parallel import software as ddp_software
from ddppipe.tasks.model import Net
from ddppipe.training.checkpoints import checkpoint
from tests.conftest import run_cli
from tests.documented_build import Build, copy_checkout
from tests.tiny import REAL_MNIST, default_config, real_mnist_sha256
from tests.workflow_helpers import job_counts, rule_graph, snakemake


def test_default_dag_rules_and_order(tmp_path: Path) -> None:
    cfg = default_config()
    counts = job_counts(tmp_path, cfg)
    assert counts == {
        "write_config": 1,
        "data_config": 1,
        "prepare_data": 1,
        "attempt_history": 1,
        "train": 1,
        "evaluate": 1,
        "export": 1,
        "plot_training": 1,
        "summarize": 1,
        "all": 1,
    }
    edges = rule_graph(tmp_path, cfg)
    for edge in [
        ("data_config", "prepare_data"),
        ("prepare_data", "train"),
        ("write_config", "train"),
        ("train", "evaluate"),
        ("train", "export"),
        ("train", "plot_training"),
        ("evaluate", "all"),
        ("export", "all"),
        ("export", "summarize"),
        ("summarize", "all"),
    ]:
        assert edge in edges, edge
    # the training evaluates its final model; the evaluate rule only presents it
    assert ("prepare_data", "evaluate") not in edges
    assert ("write_config", "prepare_data") not in edges  # the data needs no run's config


def test_invalid_config_fails_before_anything_runs(tmp_path: Path) -> None:
    cfg = default_config()
    cfg["train"]["epochz"] = 2
    result = snakemake(tmp_path, cfg, "-n", check=False)
    assert result.returncode != 0
    assert "epochz" in result.stdout + result.stderr
    assert not (tmp_path / "results").exists()


@pytest.mark.slow
def test_tiny_end_to_end(shared_build: Build) -> None:
    """Every rule ran for real on tiny data (`snakemake --cores all` of the README, in the
    shared build); a second run has nothing to do."""
    workdir = shared_build.checkout
    cfg = shared_build.config(workdir)
    run = workdir / "results" / "mnist"
    for rel in [
        "config.yaml",
        "train/final.pt",
        "train/metrics.jsonl",
        "train/training_curves.png",
        "eval/metrics.json",
        "eval/confusion_matrix.png",
        "export/model.pt",
        "export/provenance.json",
        "summary.html",
    ]:
        assert (run / rel).stat().st_size > 0, rel
    for rule in ["train", "evaluate", "export"]:
        assert (workdir / "benchmarks" / "mnist" / f"{rule}.tsv").is_file()
    again = snakemake(workdir, cfg, "-n")
    assert "Nothing to be done" in again.stdout + again.stderr


@pytest.mark.slow
def test_rules_after_training_import_no_torch(shared_build: Build, tmp_path: Path) -> None:
    """They import no torch (1.5 s and 650 MB each): run them again, on a copy of the shared
    build, with Python's import profile, which goes to each rule's log."""
    workdir = copy_checkout(shared_build.checkout, tmp_path / "copy")
    cfg = shared_build.config(workdir)
    after = ["evaluate", "plot_training", "attempt_history", "export", "summarize"]
    result = snakemake(workdir, cfg, "--cores", "2", "--forcerun", *after,
                       env={"PYTHONPROFILEIMPORTTIME": "1"})  # fmt: skip
    assert "rule train:" not in result.stdout + result.stderr  # only those after training
    for rule in after:
        log = (workdir / "logs" / "mnist" / f"{rule}.log").read_text()
        assert "| ddppipe.cli.main" in log, rule  # the profile is there
        assert not re.search(r"\|\s+torch$", log, re.MULTILINE), f"{rule} imported torch"


@pytest.mark.slow
def test_real_mnist_one_epoch(http_mirror, tmp_path: Path) -> None:
    """The DAG on real MNIST served over loopback HTTP: 2-process DDP, >= 97 % after 1 epoch."""
    cfg = default_config()
    failing = "http://127.0.0.1:9/"  # the first mirror fails
    cfg["task_args"]["mirrors"] = [failing, http_mirror(REAL_MNIST)]
    cfg["task_args"]["sha256"] = real_mnist_sha256()
    cfg["train"]["epochs"] = 1
    snakemake(tmp_path, cfg, "--cores", "2")
    run = tmp_path / "results" / cfg["run"]

    metrics = json.loads((run / "eval" / "metrics.json").read_text())
    assert metrics["test_count"] == 10_000
    assert metrics["test_accuracy"] >= 0.97
    assert len(metrics["per_class_accuracy"]) == 10
    assert sum(map(sum, metrics["confusion_matrix"])) == 10_000
    assert (run / "eval" / "confusion_matrix.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    provenance = json.loads((run / "export" / "provenance.json").read_text())
    assert provenance["training"]["world_size"] == 2
    # launch.device auto: this machine's GPU, if any, decided the recipe (and the model variant)
    gpu = torch.cuda.is_available()
    assert provenance["train_config"]["preset"] == ("gpu" if gpu else "fast")
    assert provenance["data_sha256"] == real_mnist_sha256()
    assert provenance["seed"] == 0 and provenance["epochs"] == 1
    assert provenance["config_hash"] == checkpoint.load(run / "train" / "final.pt")["config_hash"]
    # the training stack's versions (NCCL and cuDNN answer without a GPU in a CUDA build)
    assert provenance["software"]["torch"] == torch.__version__
    assert provenance["software"]["cuda"] == torch.version.cuda
    assert provenance["software"]["nccl"] == ddp_software.nccl_version()
    assert torch.version.cuda is None or provenance["software"]["nccl"] is not None
    assert provenance["software"]["cudnn"] == ddp_software.cudnn_version()

    model = Net(batchnorm=True)  # the fast and gpu recipes' variant of the seeds' CNN
    model.load_state_dict(torch.load(run / "export" / "model.pt", weights_only=True))
    history = [json.loads(x) for x in (run / "train" / "metrics.jsonl").read_text().splitlines()]
    assert history[0]["test_accuracy"] == pytest.approx(metrics["test_accuracy"])
    # `ddppipe evaluate` of the final checkpoint in a fresh process gives the same figures
    again = tmp_path / "again.json"
    run_cli("evaluate", f"--checkpoint={run / 'train' / 'final.pt'}",
            f"--config={run / 'config.yaml'}", f"--data={tmp_path / 'resources' / 'mnist'}",
            f"--metrics={again}", f"--plot={tmp_path / 'again.png'}")  # fmt: skip
    reevaluated = json.loads(again.read_text())
    # bf16: one process's batches round borderline images differently from the two ranks'
    # (seen: 1 and 4 of 10,000 moved, 2026-11-23); each moved image changes two cells
    moved = sum(abs(a - b) for row_a, row_b in zip(reevaluated["confusion_matrix"],
                metrics["confusion_matrix"], strict=True) for a, b in zip(row_a, row_b,
                strict=True))  # fmt: skip
    assert moved <= 2 * 10, (reevaluated["confusion_matrix"], metrics["confusion_matrix"])
    assert reevaluated["test_loss"] == pytest.approx(metrics["test_loss"], rel=1e-3)
