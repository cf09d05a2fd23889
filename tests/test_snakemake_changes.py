"""ddppipe's changes to Snakemake's objects (ddppipe.pipeline.snakemake_changes): installed
by one function, refused with a clear message on a Snakemake they were not written for."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ddppipe.pipeline import snakemake_changes
from tests.tiny import default_config
from tests.workflow_helpers import snakemake

REFUSED = (
    "ddppipe changes Snakemake's scheduler (the rules beside a training, the sweep's trials "
    "in order, --keep-going for a sweep: ddppipe.pipeline.snakemake_changes) as Snakemake "
    ">=9.0,<10.0 has it, and Snakemake {v} runs this workflow: install a Snakemake of that "
    "range (`make env` installs the one pyproject.toml pins), or check each change against "
    "{v} and widen ddppipe.pipeline.snakemake_changes.TESTED"
)


@pytest.mark.parametrize("version", ["9.0.0", "9.27.1", "9.99.3.dev2+g1a2b3c"])
def test_the_versions_the_changes_were_written_for_pass(version: str) -> None:
    snakemake_changes.check_version(version)


@pytest.mark.parametrize("version", ["8.30.0", "10.0.0", "10.1.0rc1", "11"])
def test_another_version_is_refused_naming_both_fixes(version: str) -> None:
    with pytest.raises(snakemake_changes.SnakemakeVersionError) as e:
        snakemake_changes.check_version(version)
    assert str(e.value) == REFUSED.format(v=version)


def test_a_workflow_run_by_another_snakemake_stops_before_any_job(tmp_path: Path) -> None:
    """The real workflow, Snakemake's version faked as 10.0.0 (a sitecustomize on the path):
    the message, exit 1, and no job ran (no data folder, no results)."""
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "sitecustomize.py").write_text("import snakemake\nsnakemake.__version__ = '10.0.0'\n")
    work = tmp_path / "work"
    path = os.pathsep.join([str(fake), *filter(None, [os.environ.get("PYTHONPATH")])])
    result = snakemake(work, default_config(), "--cores", "1", check=False,
                       env={"PYTHONPATH": path})  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    assert REFUSED.format(v="10.0.0") in result.stderr, result.stderr
    assert not (work / "resources").exists() and not (work / "results").exists()
