"""Every `snakemake`/`make` command of README.md works as typed, and every `--config` override.

The commands run in a scratch checkout (symlinks to this one) whose default config points at
tiny data: the main DAG, the scaling study and the reports for real; commands that need a
cluster, a container build or a placeholder mirror as dry runs (their real runs have tests of
their own); `make test` is what runs this test.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.tiny import REPO, TinyData, tiny_config

README = (REPO / "README.md").read_text()
LINKED = (
    "Snakefile",
    "workflow",
    "profiles",
    "containers",
    "src",
    "pyproject.toml",
    "Makefile",
    "constraints.txt",
    "examples",
)
# Markers of a command that cannot run for real here, or that is long: run with -n.
DRY = ("--profile", "container=", "/path/to/", "example.org", "results/images", "make run")


def readme_commands() -> list[str]:
    """The `snakemake ...` and `make ...` lines of the README's bash blocks, in order."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        for line in block.splitlines():
            command = re.split(r"\s+#", line, maxsplit=1)[0].strip()
            if re.match(r"(snakemake|make) ", command) and command != "make test":
                commands.append(command)
    return commands


def inline_config_overrides() -> list[str]:
    """Every `--config '...'` written in the README, in code blocks or in the text."""
    return sorted(set(re.findall(r"--config '([^']+)'", README)))


def make_checkout(root: Path, cfg: dict) -> Path:
    for name in LINKED:
        (root / name).symlink_to(REPO / name)
    if (REPO / ".venv").is_dir():
        (root / ".venv").symlink_to(REPO / ".venv")
    (root / "config").mkdir()
    (root / "config" / "config.yaml").write_text(yaml.safe_dump(cfg))
    return root


@pytest.fixture(scope="module")
def checkout(tiny: TinyData, tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = tiny_config(tiny)
    cfg["run"] = "mnist"
    cfg["scaling"].update(epochs=1, procs_per_node=[1, 2], cpus_per_proc=[1])
    return make_checkout(tmp_path_factory.mktemp("readme"), cfg)


@pytest.fixture(scope="module")
def other_task_checkout(tiny: TinyData, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """For the commands that switch task: the default config's task_args ({}: they belong to
    the task), not the tiny MNIST mirror of ``checkout``."""
    cfg = tiny_config(tiny)
    cfg["task_args"] = {}
    return make_checkout(tmp_path_factory.mktemp("readme-task"), cfg)


def run(command: str, cwd: Path) -> subprocess.CompletedProcess:
    bindir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": f"{bindir}:{os.environ.get('PATH', '')}"}
    return subprocess.run(
        command, shell=True, cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


def as_run_here(command: str) -> str:
    """The command as typed, or as a dry run when it cannot run here (see DRY)."""
    if not any(marker in command for marker in DRY):
        return command
    if command.startswith("make "):
        return f"{command} SNAKEMAKE_ARGS=-n"
    return f"{command} -n"


def test_the_readme_shows_the_commands_users_type() -> None:
    commands = readme_commands()
    assert "snakemake --profile profiles/slurm --config 'launch={nnodes: 2}'" in commands
    assert "snakemake --cores all scaling" in commands and len(commands) >= 10, commands
    assert len(inline_config_overrides()) >= 4


def test_every_readme_command_runs(checkout: Path, other_task_checkout: Path) -> None:
    failed = []
    for command in readme_commands():
        where = other_task_checkout if " task=" in command else checkout
        result = run(as_run_here(command), where)
        print(f"{result.returncode}: {as_run_here(command)}")
        if result.returncode != 0:
            failed.append(f"{command}\n{result.stdout[-1500:]}\n{result.stderr[-2500:]}")
    assert not failed, "\n\n".join(failed)
    assert (checkout / "report.html").is_file()
    assert (checkout / "results/mnist/train/attempts.html").is_file()


@pytest.mark.parametrize("override", inline_config_overrides())
def test_every_readme_config_override_is_accepted(checkout: Path, override: str) -> None:
    """Nested --config values arrive as text; they must validate as typed."""
    result = run(f"snakemake -n --cores 1 all scaling --config {shlex.quote(override)}", checkout)
    assert result.returncode == 0, result.stdout[-1500:] + result.stderr[-2500:]
