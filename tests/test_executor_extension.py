"""ddppipe's extension of the SLURM plugin's executor (ddppipe.slurm.executor): installed in
one place, on the plugin version it was written for only. Quick: no cluster."""

from __future__ import annotations

from pathlib import Path

import pytest
import snakemake_executor_plugin_slurm

from ddppipe.runstate.state import StateDir
from ddppipe.slurm import executor


def test_the_installed_plugin_is_the_one_the_extension_was_written_for() -> None:
    """Fails when the plugin changes under the extension (a new pin without a new check)."""
    assert executor.installed_version() == executor.TESTED == "2.8.0"


def test_another_plugin_version_is_refused_before_anything_changes() -> None:
    cls = type("Executor", (snakemake_executor_plugin_slurm.Executor,), {})
    extension = executor.Extension(lambda job: None, [])
    before = dict(vars(cls))
    with pytest.raises(executor.PluginVersionError) as e:
        extension.install(cls, version="2.9.0")
    assert str(e.value).startswith(
        "ddppipe extends the SLURM executor of snakemake-executor-plugin-slurm 2.8.0 "
    )
    assert "2.9.0 is installed: install snakemake-executor-plugin-slurm==2.8.0" in str(e.value)
    assert dict(vars(cls)) == before  # nothing installed


def test_every_extension_is_installed_on_the_pinned_plugin(tmp_path: Path) -> None:
    cls = type("Executor", (snakemake_executor_plugin_slurm.Executor,), {})
    executor.Extension(lambda job: None, [StateDir(tmp_path)]).install(cls)
    base = snakemake_executor_plugin_slurm.Executor
    assert isinstance(vars(cls)["_failed_nodes"], property)
    for method in ("sleep", "run_job", "report_job_error"):
        assert vars(cls)[method] is not getattr(base, method), method
    assert getattr(cls.run_job, "_ddppipe_attach", False)
    assert getattr(cls.report_job_error, "_ddppipe_early_failures", False)
