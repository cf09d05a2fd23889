"""A snakemake call ends when its work does (ddppipe.pipeline.prompt_exit): in a real Snakemake
run, no scheduler timer is left that the interpreter would wait for at its exit (without the
change each recent scheduling pass's is, the last up to 1 s)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SNAKEFILE = """
import threading
from snakemake.scheduling.job_scheduler import JobScheduler
from ddppipe.pipeline import prompt_exit

onstart:
    if config["change"]:
        prompt_exit.install(JobScheduler)

onsuccess:
    held = [t for t in threading.enumerate() if isinstance(t, threading.Timer) and not t.daemon]
    open("held", "w").write(str(len(held)))

rule all:
    input: "b"

rule a:
    output: "a"
    shell: "touch {output}"

rule b:
    input: "a"
    output: "b"
    shell: "touch {output}"
"""


@pytest.mark.parametrize("change", [True, False])
def test_no_timer_holds_the_calls_exit(tmp_path: Path, change: bool) -> None:
    (tmp_path / "Snakefile").write_text(SNAKEFILE)
    done = subprocess.run([sys.executable, "-m", "snakemake", "--cores", "1", "-q",
                           "--config", f"change={change}"],
                          cwd=tmp_path, capture_output=True, text=True, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    held = int((tmp_path / "held").read_text())
    assert held == 0 if change else held > 0  # (without: one a scheduling pass, 3 here)
