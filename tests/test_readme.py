"""Every `snakemake`/`make` command of README.md and docs/*.md works as typed, and every
`--config` override.

The commands run in a scratch checkout (symlinks to this one) whose default config points at
tiny data: the main DAG, the scaling study and the reports for real; commands that need a
cluster, a container build or a placeholder mirror as dry runs (their real runs have tests of
their own); `make test` is what runs this test. Their run is the build the end-to-end tests
share (the ``shared_build`` fixture, tests/documented_build.py).
"""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from tests import gpu_suite
from tests.documented_build import (
    DOCS,
    PAGES,
    README,
    Build,
    as_run_here,
    commands_in,
    documented_commands,
    make_checkout,
    run,
)
from tests.tiny import REPO, TinyData, tiny_config


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


@pytest.fixture(scope="module")
def checkout(tiny: TinyData, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An unbuilt checkout on tiny data, for the dry runs of the `--config` overrides."""
    cfg = tiny_config(tiny)
    cfg["run"] = "mnist"
    return make_checkout(tmp_path_factory.mktemp("readme-dry"), cfg)


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


def ran_as_documented(command: str, result: subprocess.CompletedProcess) -> bool:
    """Whether a command ended as its page says: exit 0; `make test-gpu` on a machine whose
    torch sees no GPU (CI) with its one-line refusal (docs/tests.md)."""
    if result.returncode == 0:
        return True
    gpu_command = command.startswith("make test-gpu")
    return gpu_command and not gpu_suite.cuda_gpus() and gpu_suite.NO_GPU_LINE in result.stderr


@pytest.mark.slow
def test_every_documented_command_runs(shared_build: Build) -> None:
    """The shared build is these commands, run in order (tests/documented_build.py)."""
    assert list(shared_build.results) == documented_commands()
    failed = [
        f"{as_run_here(command)}\n{result.stdout[-1500:]}\n{result.stderr[-2500:]}"
        for command, result in shared_build.results.items()
        if not ran_as_documented(command, result)
    ]
    assert not failed, "\n\n".join(failed)
    checkout, other_task = shared_build.checkout, shared_build.other_task
    assert (checkout / "report.html").is_file()
    assert (checkout / "results/mnist/train/attempts.html").is_file()
    assert (checkout / "results/sweeps/scaling/time_to_accuracy.csv").is_file()
    for run_name in ("digits", "tinycnn"):  # the commands that switch task
        assert (other_task / "results" / run_name / "export/model.pt").is_file(), run_name


@pytest.mark.parametrize("override", inline_config_overrides())
def test_every_documented_config_override_is_accepted(checkout: Path, override: str) -> None:
    """Nested --config values arrive as text; they must validate as typed."""
    result = run(f"snakemake -n --cores 1 all scaling --config {shlex.quote(override)}", checkout)
    assert result.returncode == 0, result.stdout[-1500:] + result.stderr[-2500:]
