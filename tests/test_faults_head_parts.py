"""The parts of attaching, excluding a bad node and the head job that need no cluster (the
whole: tests/test_faults_head_and_node.py)."""

from __future__ import annotations

import sys
from pathlib import Path

from snakemake.jobs import Wildcards
from snakemake_executor_plugin_slurm.utils import get_job_wildcards

from ddppipe.parallel import node_check
from ddppipe.slurm import head, squeue
from ddppipe.slurm.executor import attach


class _Job:
    """What the plugin's get_job_wildcards reads of a job."""

    def __init__(self, **wildcards: str) -> None:
        self.wildcards = Wildcards(fromdict=wildcards)


def test_comment_is_the_plugins() -> None:
    job = _Job(run="scaling-n2-p1-c1")
    assert (
        f"rule_train_wildcards_{get_job_wildcards(job)}" == "rule_train_wildcards_scaling-n2-p1-c1"
    )
    assert attach.comment("train", job.wildcards) == "rule_train_wildcards_scaling-n2-p1-c1"
    assert attach.comment("train", ["a/b"]) == "rule_train_wildcards_a_b"
    assert attach.comment("train", []) == "rule_train"


def test_only_live_jobs_of_the_run_and_directory_are_found(tmp_path: Path) -> None:
    here, other = tmp_path / "wd", tmp_path / "other"
    queue = "\n".join([
        f"3|FAILED|r|rule_train_wildcards_tiny|{here}",  # ended
        f"7|RUNNING|r|rule_train_wildcards_tiny|{other}",  # another checkout's
        f"8|PENDING|r|rule_train_wildcards_tiny2|{here}",  # another run
        f"12|REQUEUED|r|rule_train_wildcards_tiny|{here}",
        f"9|RUNNING|r|rule_train_wildcards_tiny|{here}/.",
    ])  # fmt: skip
    found = attach.live(squeue.parse(queue), "rule_train_wildcards_tiny", here)
    assert found == [attach.LiveJob("9", "RUNNING"), attach.LiveJob("12", "REQUEUED")]


def test_failing_nodes_are_the_ones_whose_check_failed() -> None:
    stderr = (
        "preflight: gpu2: does not see the run's state folder as the job's first node does\n"
        "srun: error: gpu2: task 1: Exited with exit code 3\n"
    )
    assert node_check.failing_nodes(stderr, ["gpu1", "gpu2", "gpu3"]) == ["gpu2"]


def test_head_job_request() -> None:
    argv = head.sbatch_argv(
        Path("/home/me/ddppipe"), "2-00:00:00", "login", None,
        ["--profile", "profiles/slurm", "--config", "launch={nnodes: 2}"],
    )  # fmt: skip
    assert argv == [
        "sbatch", "--parsable", "--job-name=ddppipe-head", "--chdir=/home/me/ddppipe",
        "--output=logs/head/%j.log", "--open-mode=append", "--time=2-00:00:00", "--nodes=1",
        "--ntasks=1", "--cpus-per-task=1", "--mem=2000", "--requeue", "--signal=B:USR1@120",
        "--partition=login", "--wrap",
        f"exec {sys.executable} -m ddppipe head -- --profile profiles/slurm --config "
        "'launch={nnodes: 2}'",
    ]  # fmt: skip
