"""Trials in their order (ddppipe.pipeline.in_order), in a real Snakemake run of a small
workflow: six trials, one slot, each trial's training after its config, the configs ending
in the reverse order (the last trial's first). The trainings start in the trials' order
(Snakemake's default selector, ILP); a trial whose config failed holds no later one back.
Without the extension they start in the reverse order (measured: 5, 4, 3, 2, 1, 0).
(One call, ~8 s: the greedy selector ranks by the same priority first.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ddppipe.pipeline import in_order

TRIALS, FAILS = 6, 3  # (trial 3's config fails)
SNAKEFILE = f"""
from snakemake.scheduling.job_scheduler import JobScheduler
from ddppipe.pipeline import in_order

workflow.register_resource("slot", 1)


def place(job):
    return int(job.wildcards_dict["t"]) if job.name == "train" else None


onstart:
    in_order.install(JobScheduler, place)

rule all:
    input: expand("trained/{{t}}", t=range({TRIALS}))

rule config:  # trial t's config ends after 0.2 s per trial after it; one fails
    output: "config/{{t}}"
    threads: 0
    params: delay=lambda wc: 0.2 * ({TRIALS} - int(wc.t)), fail=lambda wc: config["fail"]
    shell: "sleep {{params.delay}}; test {{wildcards.t}} != {{params.fail}}; touch {{output}}"

rule train:
    input: "config/{{t}}"
    output: "trained/{{t}}"
    resources: slot=1
    priority: lambda wc: in_order.priority(int(wc.t), {TRIALS})
    shell: "date +%s.%N > {{output}}; sleep 0.1"
"""


def test_trials_train_in_their_order(tmp_path: Path) -> None:
    (tmp_path / "Snakefile").write_text(SNAKEFILE)
    done = subprocess.run([sys.executable, "-m", "snakemake", "--cores", "2", "-q",
                           "--keep-going", "--config", f"fail={FAILS}"],
                          cwd=tmp_path, capture_output=True, text=True, check=False)  # fmt: skip
    assert done.returncode != 0 and not (tmp_path / "trained" / str(FAILS)).exists()
    trained = [t for t in range(TRIALS) if t != FAILS]
    starts = [float((tmp_path / "trained" / str(t)).read_text()) for t in trained]
    assert starts == sorted(starts), dict(zip(trained, starts, strict=True))


def test_the_earlier_the_higher_priority() -> None:
    assert [in_order.priority(p, 3) for p in range(3)] == [3, 2, 1]
    assert in_order.priority(5, 3) == 1  # never below another job's 0
