"""Which jobs a change re-runs: dry runs against outputs that are already built."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.documented_build import Build
from tests.workflow_helpers import job_counts, snakemake

pytestmark = pytest.mark.slow  # the shared build of the local DAG


@pytest.fixture(scope="module")
def built(shared_build: Build) -> tuple[Path, dict]:
    """The main run and its scaling study, built for real by the documented commands (only
    dry runs here: the build stays as it is)."""
    return shared_build.checkout, shared_build.config(shared_build.checkout)


def test_nothing_to_do_when_built(built: tuple[Path, dict]) -> None:
    workdir, cfg = built
    out = snakemake(workdir, cfg, "-n", "all", "scaling").stdout
    assert "Nothing to be done" in out, out


def test_a_new_run_name_leaves_the_data_and_other_runs_alone(built: tuple[Path, dict]) -> None:
    workdir, cfg = built
    counts = job_counts(workdir, cfg, "all", "scaling", "--config", "run=other")
    assert counts.get("train") == 1, counts  # only the new run trains
    assert "prepare_data" not in counts and "data_config" not in counts, counts
    assert "plot_scaling" not in counts, counts


def test_changing_lr_reruns_only_that_runs_training_and_what_follows(
    built: tuple[Path, dict],
) -> None:
    """Also a nested `--config` value, which Snakemake passes on as text."""
    workdir, cfg = built
    counts = job_counts(workdir, cfg, "all", "--config", "train={lr: 0.0123}")
    assert counts == {
        "write_config": 1, "train": 1, "evaluate": 1, "export": 1, "plot_training": 1,
        "attempt_history": 1, "summarize": 1, "all": 1,
    }, counts  # fmt: skip


def test_changing_the_data_settings_reruns_the_download(built: tuple[Path, dict]) -> None:
    workdir, cfg = built
    counts = job_counts(workdir, cfg, "all", "--config", "task_args={timeout_s: 7}")
    assert counts.get("data_config") == 1 and counts.get("prepare_data") == 1, counts
