"""Which executor a snakemake call runs, read from its command line and profile while the
Snakefile is read (ddppipe.slurm.call_executor)."""

from __future__ import annotations

from pathlib import Path

from ddppipe.slurm.call_executor import executor_of_call
from tests.tiny import REPO


def profile(folder: Path, executor: str) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(f"executor: {executor}\njobs: 8\n")
    return folder


def test_the_command_line_names_it() -> None:
    assert executor_of_call(["snakemake", "--executor", "slurm", "-n"], {}) == "slurm"
    assert executor_of_call(["snakemake", "-e", "slurm"], {}) == "slurm"
    assert executor_of_call(["snakemake", "--executor=cluster-generic"], {}) == "cluster-generic"
    assert executor_of_call(["snakemake", "--cores", "all", "sweep"], {}) == "local"


def test_the_profile_names_it(tmp_path: Path) -> None:
    assert executor_of_call(["snakemake", "--profile", str(REPO / "profiles/slurm")], {}) == (
        "slurm"
    )
    mine = profile(tmp_path / "xdg" / "snakemake" / "mycluster", "slurm")
    env = {"XDG_CONFIG_HOME": str(tmp_path / "xdg"), "HOME": str(tmp_path)}
    assert executor_of_call(["snakemake", "--profile", "mycluster"], env) == "slurm"
    assert executor_of_call(["snakemake"], {**env, "SNAKEMAKE_PROFILE": str(mine)}) == "slurm"
    # the command line wins over the profile; a profile without an executor is local
    assert executor_of_call(["snakemake", "--profile", str(mine), "-e", "local"], env) == "local"
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.yaml").write_text("cores: 4\n")
    assert executor_of_call(["snakemake", f"--profile={plain}"], env) == "local"
    assert executor_of_call(["snakemake", "--profile", "no-such-profile"], env) == "local"
