"""The one build of the local DAG that the end-to-end tests share.

Every `snakemake`/`make` command of README.md and docs/*.md runs once, as typed (or as a dry
run where it needs a cluster, a container build or a placeholder mirror: see DRY), in a
scratch checkout (symlinks to this one) whose default config points at tiny data. The
commands build the main run (``mnist``, 2 epochs on tiny data), the scaling study (world
sizes 1 and 2) and its report in ``checkout``; the commands that switch task build the
example task file's run (``tinycnn``) and the digits run in ``other_task``.

Who asserts what on it: tests/test_readme.py (every command succeeded), tests/test_workflow.py
(the main run's files; nothing left to do; what the rules after training import, on a copy),
tests/test_dag.py (which jobs a change re-runs: dry runs only), tests/test_scaling.py (the
study's outputs and the report, in headless Chromium) and tests/test_own_code.py (the example
task file's run; an edit of the file, undone with its time stamp). No test changes the build
in place: a test that re-runs jobs copies it first (``copy_checkout``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
    "tests",  # make test-gpu's runner (tests/gpu_suite.py)
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


# What runs the tests (this one among them): `make test-quick` is checked by its dry run
# (tests/test_readme.py) and runs for real narrowed to a file (docs/tests.md's TESTS=).
RUN_THE_TESTS = ("make test", "make test-quick")


def documented_commands() -> list[str]:
    """The commands of the README and of every docs/*.md, in order, each once, but those that
    run the whole suite (:data:`RUN_THE_TESTS`)."""
    every = [c for text in PAGES.values() for c in commands_in(text)]
    return [c for c in dict.fromkeys(every) if c not in RUN_THE_TESTS]


def as_run_here(command: str) -> str:
    """The command as typed, or as a dry run when it cannot run here (see DRY)."""
    if not any(marker in command for marker in DRY):
        return command
    if command.startswith("make "):
        return f"{command} SNAKEMAKE_ARGS=-n"
    return f"{command} -n"


def make_checkout(root: Path, cfg: dict[str, Any]) -> Path:
    """A scratch checkout: symlinks to this one, ``cfg`` as its config/config.yaml, and a copy
    of examples/ (a test edits the example task file there, never the repository's)."""
    root.mkdir(parents=True, exist_ok=True)
    for name in LINKED:
        (root / name).symlink_to(REPO / name)
    shutil.copytree(REPO / "examples", root / "examples")
    if (REPO / ".venv").is_dir():
        (root / ".venv").symlink_to(REPO / ".venv")
    (root / "config").mkdir()
    (root / "config" / "config.yaml").write_text(yaml.safe_dump(cfg))
    return root


def copy_checkout(checkout: Path, to: Path) -> Path:
    """A copy of a built checkout (time stamps and Snakemake's records kept) to change."""
    shutil.copytree(checkout, to, symlinks=True)
    return to


def run(command: str, cwd: Path) -> subprocess.CompletedProcess:
    bindir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": f"{bindir}:{os.environ.get('PATH', '')}"}
    return subprocess.run(
        command, shell=True, cwd=cwd, env=env, capture_output=True, text=True, timeout=900
    )


def main_config(tiny: TinyData) -> dict[str, Any]:
    """The main checkout's config: run ``mnist``, 2 epochs on tiny data, a study of world
    sizes 1 and 2 (2 epochs each) with one target it reaches and one it does not."""
    cfg = tiny_config(tiny, epochs=2)
    cfg["run"] = "mnist"
    cfg["scaling"] = {
        "nodes": [1],
        "procs_per_node": [1, 2],
        "cpus_per_proc": [1],
        "epochs": 2,
        "accuracy_targets": [0.5, 0.999],
    }
    return cfg


def other_task_config(tiny: TinyData) -> dict[str, Any]:
    """For the commands that switch task: the default config's task_args ({}: they belong to
    the task), not the tiny MNIST mirror; 2 epochs of batches of 64."""
    cfg = tiny_config(tiny, epochs=2, batch_size=64, eval_batch_size=256)
    cfg["task_args"] = {}
    return cfg


@dataclass(frozen=True)
class Build:
    checkout: Path  # the main run, the scaling study and report.html
    other_task: Path  # the runs of the commands with ` task=` (tinycnn, digits)
    results: dict[str, subprocess.CompletedProcess]  # command as typed -> its run

    def config(self, where: Path, **keys: Any) -> dict[str, Any]:
        """The config a checkout's commands ran with, ``keys`` set (as `--config` would)."""
        cfg = yaml.safe_load((where / "config" / "config.yaml").read_text())
        cfg.update(keys)
        return cfg


def build(tiny: TinyData, root: Path) -> Build:
    """Run every documented command, in order, in the checkout it belongs to."""
    checkout = make_checkout(root / "readme", main_config(tiny))
    other_task = make_checkout(root / "readme-task", other_task_config(tiny))
    results = {}
    for command in documented_commands():
        where = other_task if " task=" in command else checkout
        results[command] = result = run(as_run_here(command), where)
        print(f"{result.returncode}: {as_run_here(command)}")
    return Build(checkout, other_task, results)
