"""Rules beside a training (ddppipe.pipeline.beside): a zero-thread job that becomes ready
while another job holds every core starts at once, in a real Snakemake run of a small
workflow (without the extension it waits for the core holder's end: measured 4.0 s of 4.0)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SNAKEFILE = """
from snakemake.scheduling.job_scheduler import JobScheduler
from ddppipe.pipeline import beside

onstart:
    beside.install(JobScheduler)

rule all:
    input: "beside", "hold"

rule quick:  # ready at once, ends after 1 s: then rule beside is ready
    output: "quick"
    threads: 0
    shell: "sleep 1; touch {output}"

rule beside:
    input: "quick"
    output: "beside"
    threads: 0
    shell: "date +%s.%N > {output}"

rule hold:  # every core, 4 s
    output: "hold"
    threads: 2
    shell: "date +%s.%N > {output}; sleep 4; date +%s.%N >> {output}"
"""


def test_a_zero_thread_job_starts_while_another_holds_every_core(tmp_path: Path) -> None:
    (tmp_path / "Snakefile").write_text(SNAKEFILE)
    done = subprocess.run([sys.executable, "-m", "snakemake", "--cores", "2", "-q"],
                          cwd=tmp_path, capture_output=True, text=True, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    started = float((tmp_path / "beside").read_text())
    hold_start, hold_end = (float(t) for t in (tmp_path / "hold").read_text().split())
    assert hold_start + 0.9 < started < hold_end - 1.5, (
        started - hold_start,
        hold_end - hold_start,
    )
