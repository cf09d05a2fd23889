"""The cluster policy check: settings that would hang the workflow or lose work, found
before anything is submitted (unit tests of each rule, and real misconfigured clusters)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from ddppipe.settings import run_spec as run_spec
from ddppipe.slurm import cluster_policy
from ddppipe.slurm import request as slurm_request
from ddppipe.slurm.cluster_policy import Cluster
from tests.slurm_cluster import SlurmCluster
from tests.slurm_fixtures import SlurmSlot
from tests.test_slurm import FINAL, on_cluster, snakemake_slurm
from tests.tiny import REPO, default_config, make_tiny, tiny_config

GOOD_CONFIG = {
    "PreemptType": "preempt/partition_prio", "PreemptMode": "REQUEUE", "JobRequeue": "1",
    "KillWait": "30 sec", "MinJobAge": "300 sec",
    "AccountingStorageType": "accounting_storage/none",
}  # fmt: skip
GOOD_PARTITION = {"PartitionName": "gpu", "PreemptMode": "REQUEUE", "GraceTime": "120"}


def findings(conf: dict | None = None, part: dict | None = None, status: str = "squeue",
             requeue: bool = True, checkpoint_s: float | None = 5.0) -> list[str]:  # fmt: skip
    cluster = Cluster({**GOOD_CONFIG, **(conf or {})}, {**GOOD_PARTITION, **(part or {})})
    request = slurm_request.Request.from_spec(run_spec.resolve(default_config(), gpus=False))
    return [str(f) for f in cluster_policy.check(cluster, request, status, requeue, checkpoint_s)]


def test_a_good_cluster_has_no_findings() -> None:
    assert findings() == []
    assert findings({"JobRequeue": "0"}) == []  # the profile's --requeue makes up for it
    assert findings({"PreemptType": "preempt/none"}, {"PreemptMode": "CANCEL"}) == []


@pytest.mark.parametrize(
    ("conf", "part", "status", "requeue", "message"),
    [
        ({}, {"PreemptMode": "CANCEL"}, "squeue", True, "PreemptMode=CANCEL (partition gpu)"),
        ({"PreemptMode": "CANCEL"}, {"PreemptMode": ""}, "squeue", True, "waits forever"),
        ({"JobRequeue": "0"}, {}, "squeue", False, "jobs cannot be requeued"),
        ({"KillWait": "5 sec"}, {}, "squeue", True, "KillWait=5s"),
        ({"MinJobAge": "60 sec"}, {}, "squeue", True, "MinJobAge=60s with status command"),
        ({}, {}, "sacct", True, "sacct never sees the jobs"),
    ],
)
def test_each_bad_setting_is_named(
    conf: dict, part: dict, status: str, requeue: bool, message: str
) -> None:
    found = findings(conf, part, status, requeue)
    assert len(found) == 1 and message in found[0], found


def test_checkpoint_times_compare_only_once_measured() -> None:
    assert findings({"KillWait": "5 sec"}, checkpoint_s=None) == []
    assert findings({"MinJobAge": "0 sec"}) == []  # 0: slurmctld never purges job records


def test_scontrol_formats_are_read() -> None:
    text = "KillWait                = 30 sec\nMinJobAge = 300 sec\nOverTimeLimit = 0 min\n"
    conf = cluster_policy.parse_config(text)
    assert cluster_policy.seconds(conf["KillWait"]) == 30
    assert cluster_policy.seconds("00:01:30") == 90


# -- real clusters configured badly -------------------------------------------------------


def profile_without_requeue(tmp_path: Path) -> str:
    profile = yaml.safe_load((REPO / "profiles/slurm/config.yaml").read_text())
    profile["slurm-requeue"] = False
    folder = tmp_path / "profile"
    folder.mkdir()
    (folder / "config.yaml").write_text(yaml.safe_dump(profile))
    return str(folder)


def assert_nothing_submitted(cluster: SlurmCluster) -> None:
    out = cluster.run(["squeue", "-h", "-t", "all", "-o", "%i"]).stdout
    assert out.strip() == "", f"jobs were submitted: {out}"


@pytest.mark.slurm
def test_cancelling_preemption_requeue_off_and_short_min_job_age(
    slurm_slot: SlurmSlot, tmp_path: Path
) -> None:
    """A cluster (nodes g1, g2) whose training partition `batch` cancels preempted jobs,
    with JobRequeue=0 and MinJobAge=60: each is named before anything is submitted."""
    shape = {
        "nodes": ("g1", "g2"),
        "partitions": {
            "batch": "Default=YES State=UP PriorityTier=1 PreemptMode=CANCEL",
            "urgent": "State=UP PriorityTier=10 PreemptMode=OFF",
        },
        "settings": {"JobRequeue": "0", "MinJobAge": "60"},
    }
    with slurm_slot.suspended(), slurm_slot.new_cluster("slurm-bad", **shape) as cluster:
        cfg = on_cluster(tiny_config(make_tiny(tmp_path / "tiny")), cluster, nodes=1)
        profile = profile_without_requeue(tmp_path)
        result = snakemake_slurm(cluster, tmp_path / "wd", cfg, FINAL, profile=profile)
        text = result.stdout + result.stderr
        print(text[text.find("this cluster's settings") :][:2000])
        assert result.returncode != 0
        assert "nothing was submitted" in text
        assert "PreemptMode=CANCEL (partition batch)" in text
        assert "JobRequeue=0 and the profile's slurm-requeue is off" in text
        assert "MinJobAge=60s with status command squeue" in text
        assert_nothing_submitted(cluster)


def refused(cluster: SlurmCluster, wd: Path, *args: str) -> str:
    """Run a tiny 1-node training with the SLURM profile; the check must refuse it: its text."""
    cfg = on_cluster(tiny_config(make_tiny(wd.parent / "tiny")), cluster, nodes=1)
    result = snakemake_slurm(cluster, wd, cfg, FINAL, *args)
    text = result.stdout + result.stderr
    assert result.returncode != 0, text
    assert not list(wd.glob(".snakemake/slurm_logs/**/*.log")), text  # no job submitted
    return text


@pytest.mark.slurm
def test_sacct_status_without_accounting_is_refused(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    text = refused(slurm_cluster, tmp_path / "wd", "--slurm-status-command", "sacct")
    assert "sacct never sees the jobs" in text, text


@pytest.mark.slurm
def test_kill_wait_shorter_than_the_measured_checkpoint(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """The test cluster's KillWait is 5 s; an earlier slot of the run measured 30 s."""
    wd = tmp_path / "wd"
    state = wd / "results/tiny/state"
    state.mkdir(parents=True)
    earlier = {"number": 1, "job": "7", "restarts": 0, "nodes": ["x"], "start": 0.0,
               "outcome": "time limit", "checkpoint_seconds": 30.0}  # fmt: skip
    (state / "attempts.json").write_text(json.dumps([earlier]))
    text = refused(slurm_cluster, wd)
    assert "KillWait=5s" in text and "took up to 30.0s" in text, text
