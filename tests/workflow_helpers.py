"""Running the Snakemake workflow from tests, in a scratch working directory."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from tests.tiny import REPO

STAMP = re.compile(r"^\[(\w{3} \w{3} +\d+ \d\d:\d\d:\d\d \d{4})\]$")  # Snakemake's log


def stamps(log: str, pattern: str) -> list[float]:
    """Unix times of a Snakemake log's time stamps that precede a line matching ``pattern``."""
    found, last = [], None
    for line in log.splitlines():
        match = STAMP.match(line.strip())
        if match:
            last = time.mktime(time.strptime(match[1], "%a %b %d %H:%M:%S %Y"))
        elif last is not None and re.search(pattern, line):
            found.append(last)
    return found


def snakemake(
    workdir: Path,
    cfg: dict[str, Any],
    *args: str,
    timeout: float = 1200,
    check: bool = True,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """Run the repository's Snakefile in ``workdir`` with ``cfg`` as its config file (and
    ``env`` added to the environment)."""
    workdir.mkdir(parents=True, exist_ok=True)
    cfg_path = workdir / "test-config.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    bindir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": f"{bindir}:{os.environ.get('PATH', '')}", **(env or {})}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "snakemake",
            "-s",
            str(REPO / "Snakefile"),
            "-d",
            str(workdir),
            "--configfile",
            str(cfg_path),
            *args,
        ],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and result.returncode != 0:
        raise AssertionError(f"snakemake {args} failed:\n{result.stdout}\n{result.stderr}")
    return result


def rule_graph(workdir: Path, cfg: dict[str, Any], *targets: str) -> set[tuple[str, str]]:
    """Edges (upstream rule, downstream rule) of the rule graph."""
    dot = snakemake(workdir, cfg, "--rulegraph", *targets).stdout
    labels = dict(re.findall(r'^\s*(\d+)\[label = "([^"]+)"', dot, re.M))
    edges = re.findall(r"^\s*(\d+) -> (\d+)", dot, re.M)
    return {(labels[a], labels[b]) for a, b in edges}


def job_counts(workdir: Path, cfg: dict[str, Any], *args: str) -> dict[str, int]:
    """Rule -> number of jobs in a dry run."""
    out = snakemake(workdir, cfg, "-n", *args).stdout
    table = out.split("Job stats:")[1]
    return {m[0]: int(m[1]) for m in re.findall(r"^(\w+)\s+(\d+)$", table, re.M) if m[0] != "total"}
