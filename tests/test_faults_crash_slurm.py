"""A user's model that crashes on one rank of a two-node SLURM job (cn07, cn08): the cause
named in the attempt record and the last lines printed; a crash that repeats at the same step
is not retried again (the profile's ``retries: 2``)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from tests.slurm_cluster import SlurmCluster
from tests.test_faults_crash import CRASHING_TASK, failed_line, last_lines
from tests.test_slurm import logs, on_cluster, snakemake_slurm, train_job_ids
from tests.tiny import make_tiny, tiny_config

pytestmark = pytest.mark.slurm


def test_a_crash_on_one_node_is_named_and_not_retried_forever(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """Rank 1 (one rank a node) raises in its forward at step 5: the job fails; its retry
    trains into the same crash, and is recorded as final; the last retry refuses in seconds."""
    wd = tmp_path / "wd"
    (wd / "tasks").mkdir(parents=True)
    (wd / "tasks" / "crashy.py").write_text(CRASHING_TASK)
    cfg = tiny_config(make_tiny(tmp_path / "tiny"), epochs=2)
    cfg.update(run="crashy", task="tasks/crashy.py")
    cfg = on_cluster(cfg, slurm_cluster, nodes=2, procs=1)
    line = 1 + next(i for i, t in enumerate(CRASHING_TASK.splitlines()) if "raise Runtime" in t)
    started = time.monotonic()
    result = snakemake_slurm(slurm_cluster, wd, cfg, timeout=400)
    wall, ended = time.monotonic() - started, time.time()
    text = result.stdout + result.stderr
    assert result.returncode != 0, logs(wd, result)
    history = json.loads((wd / "results/crashy/state/attempts.json").read_text())
    assert [a["outcome"] for a in history] == ["crashed (exit 1)"] * 2, logs(wd, result)
    failure = history[-1]["failure"]
    assert failure["host"] in slurm_cluster.nodes and failure["rank"] == 1, failure
    cause = (f"rank 1 on {failure['host']}: RuntimeError: shape trouble in batch 5 at "
             f"tasks/crashy.py:{line} (in forward), step 5 (epoch 1)")  # fmt: skip
    assert [a["detail"] for a in history] == [
        cause, f"{cause} (slots 1 and 2 failed the same way: not retried)"
    ]  # fmt: skip
    assert failed_line(text) == history[-1]["detail"], last_lines(text)
    # the profile's two retries: the second trained into the same crash, the third refused
    assert len(train_job_ids(result)) == 3, text
    train_log = (wd / "logs/crashy/train.log").read_text()
    refused = f"not training: slots 1 and 2 failed the same way: {cause}"
    assert refused in train_log, train_log[-3000:]
    assert not (wd / "results/crashy/train/final.pt").exists()
    to_end = [a["end"] - a["failure"]["time"] for a in history]
    print(f"(crash on SLURM) snakemake ran {wall:.0f}s; from rank 1's exception to its slot's "
          f"end {to_end[0]:.1f}s, {to_end[1]:.1f}s; from the second exception to snakemake's "
          f"end (the third try refused) {ended - history[1]['failure']['time']:.1f}s; the last "
          f"lines:\n{last_lines(text)}\n(the third try) "
          + re.findall(r".*not training: .*", train_log)[-1])  # fmt: skip
