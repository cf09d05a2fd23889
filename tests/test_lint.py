"""Snakemake's own conventions: `snakemake --lint` and `snakefmt --check` stay clean."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.tiny import REPO

BIN = Path(sys.executable).parent
# The one finding that is wrong for this workflow (why: the comment in the Snakefile).
ALLOWED = {"Specify a conda environment or container for each rule."}


def test_snakemake_lint_finds_nothing_else() -> None:
    result = subprocess.run(
        [str(BIN / "snakemake"), "--lint"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    text = result.stdout + result.stderr
    findings = set(re.findall(r"^\s+\* (.+?):?$", text, re.M))
    assert findings, f"no lint output to check (did the format change?):\n{text[-2000:]}"
    assert findings <= ALLOWED, f"new lint findings {findings - ALLOWED}:\n{text[-4000:]}"


def test_snakefmt_check() -> None:
    result = subprocess.run(
        [str(BIN / "snakefmt"), "--check", "Snakefile", "workflow"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
