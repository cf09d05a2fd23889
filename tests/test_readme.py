"""Every `snakemake`/`make` command of README.md and docs/*.md works as typed, and every
`--config` override.

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
DOCS = sorted((REPO / "docs").glob("*.md"))
# The README first, then the docs: commands run in this order (a report after its run).
PAGES = {"README.md": README} | {f"docs/{p.name}": p.read_text() for p in DOCS}
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


def commands_in(text: str) -> list[str]:
    """The `snakemake ...` and `make ...` lines of a page's bash blocks, in order."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.splitlines():
            command = re.split(r"\s+#", line, maxsplit=1)[0].strip()
            if re.match(r"(snakemake|make)( |$)", command):
                commands.append(command)
    return commands


def documented_commands() -> list[str]:
    """The commands of the README and of every docs/*.md, in order, each once; `make test`
    is what runs this test."""
    every = [c for text in PAGES.values() for c in commands_in(text)]
    return [c for c in dict.fromkeys(every) if c != "make test"]


def inline_config_overrides() -> list[str]:
    """Every value of a `--config '...' ['...']` written in the README or a doc, in code
    blocks or in the text."""
    found = set()
    for text in PAGES.values():
        for values in re.findall(r"--config((?:\s+'[^']+')+)", text):
            found.update(re.findall(r"'([^']+)'", values))
    return sorted(found)


def rule_names() -> set[str]:
    return {
        name
        for smk in (REPO / "workflow" / "rules").glob("*.smk")
        for name in re.findall(r"^\s*rule (\w+):", smk.read_text(), re.M)
    }


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    return {slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


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
    """The set-up commands and the SLURM and container one-liners are on the first page."""
    readme = commands_in(README)
    assert "make run" in readme and "make test" in readme, readme
    assert "snakemake --profile profiles/slurm --config 'launch={nnodes: 2}'" in readme
    assert "snakemake --cores all --config 'container={mode: apptainer}'" in readme
    commands = documented_commands()
    assert "snakemake --cores all scaling" in commands and len(commands) >= 10, commands
    assert len(inline_config_overrides()) >= 4


def test_the_readme_names_every_rule() -> None:
    missing = sorted(name for name in rule_names() if name not in README)
    assert len(rule_names()) >= 10 and not missing, missing


def test_the_readme_links_every_doc_and_every_link_resolves() -> None:
    assert DOCS, "docs/*.md"
    linked = set(re.findall(r"\]\((docs/[^)#]+\.md)", README))
    assert {f"docs/{p.name}" for p in DOCS} <= linked, linked
    broken = []
    for page, text in PAGES.items():
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # a web address
            path, _, anchor = target.partition("#")
            file = (REPO / page).parent / path if path else REPO / page
            if not file.exists():
                broken.append(f"{page}: {target}")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
                broken.append(f"{page}: {target} (no such heading)")
    assert not broken, broken


def test_every_documented_command_runs(checkout: Path, other_task_checkout: Path) -> None:
    failed = []
    for command in documented_commands():
        where = other_task_checkout if " task=" in command else checkout
        result = run(as_run_here(command), where)
        print(f"{result.returncode}: {as_run_here(command)}")
        if result.returncode != 0:
            failed.append(f"{command}\n{result.stdout[-1500:]}\n{result.stderr[-2500:]}")
    assert not failed, "\n\n".join(failed)
    assert (checkout / "report.html").is_file()
    assert (checkout / "results/mnist/train/attempts.html").is_file()


@pytest.mark.parametrize("override", inline_config_overrides())
def test_every_documented_config_override_is_accepted(checkout: Path, override: str) -> None:
    """Nested --config values arrive as text; they must validate as typed."""
    result = run(f"snakemake -n --cores 1 all scaling --config {shlex.quote(override)}", checkout)
    assert result.returncode == 0, result.stdout[-1500:] + result.stderr[-2500:]
