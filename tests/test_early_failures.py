"""A training job that fails before its launcher starts (ddppipe.slurm.executor.early_failures,
ddppipe.runstate.prelaunch_failures): the error read from what the job's own Snakemake printed,
and the crash rule before training. On SLURM end to end: tests/test_sweep_slurm.py."""

from __future__ import annotations

from pathlib import Path

from ddppipe.runstate import prelaunch_failures
from ddppipe.runstate.prelaunch_failures import EarlyFailure
from ddppipe.runstate.state import StateDir
from ddppipe.slurm.executor.early_failures import error_of_log
from tests.tiny import default_config
from tests.workflow_helpers import snakemake


def job_output(workdir: Path, cfg: dict, *args: str) -> str:
    """What a job's own Snakemake prints when it fails before its rule runs (the plugin's
    job step runs the rule with --target-jobs)."""
    result = snakemake(workdir, cfg, "-n", *args, check=False)
    assert result.returncode != 0, result.stdout[-3000:]
    return result.stdout + result.stderr


def test_the_error_of_a_job_whose_wildcard_the_plugin_cut(tmp_path: Path) -> None:
    """The job of issue #32: a trial name with a comma, cut by the plugin's --target-jobs."""
    cfg = default_config()
    cfg["sweep"] = {"name": "rnd", "parameters": {"train.lr": [0.00886], "train.batch_size": [128]}}
    text = job_output(tmp_path, cfg, "--target-jobs",
                      "train:run=sweeps/rnd/lr=0.00886,batch_size=128")  # fmt: skip
    error = error_of_log(text)
    assert error is not None and error.startswith(
        "InputFunctionException in rule train: ConfigError: unknown run "
        "'sweeps/rnd/lr=0.00886': this config defines the runs "
    ), error


def test_the_error_of_a_job_on_a_node_without_the_task_file(tmp_path: Path) -> None:
    cfg = default_config()
    cfg["task"] = "tasks/gone.py"
    error = error_of_log(job_output(tmp_path, cfg))
    assert error is not None and error.startswith(
        f"WorkflowError: task 'tasks/gone.py': no such file ({tmp_path / 'tasks/gone.py'}); "
    ), error


def test_the_error_of_a_traceback_and_of_a_shell() -> None:
    traceback = (
        "Traceback (most recent call last):\n"
        '  File "/opt/venv/bin/ddppipe", line 5, in <module>\n'
        "    from ddppipe.cli.main import main\n"
        "ModuleNotFoundError: No module named 'ddppipe'\n"
        "[Thu Nov 26 10:00:00 2026]\nError in rule train:\n    jobid: 0\n"
    )
    assert error_of_log(traceback) == "ModuleNotFoundError: No module named 'ddppipe'"
    shell = "/usr/bin/bash: line 1: ddppipe: command not found\nError in rule train:\n"
    assert error_of_log(shell) == "ddppipe: command not found"
    assert error_of_log("srun: job 7 queued and waiting for resources\n") is None


def failure(
    job: str, at: float, error: str = "WorkflowError: task 'x.py': no such file"
) -> EarlyFailure:
    return EarlyFailure(job, at, error, f".snakemake/slurm_logs/rule_train/x/{job}.log")


def test_a_second_identical_early_failure_is_final() -> None:
    first, second = failure("3", 100.0), failure("6", 130.0)
    assert not prelaunch_failures.repeated([first], [])
    assert prelaunch_failures.repeated([first, second], [])
    other = failure("6", 130.0, "ModuleNotFoundError: No module named 'mytask'")
    assert not prelaunch_failures.repeated([first, other], [])
    # a slot that trained between them: the run got further; this one is the first again
    assert not prelaunch_failures.repeated([first, second], [110.0])


def test_a_slot_started_after_an_early_failure_tells_the_runs_story(tmp_path: Path) -> None:
    state = StateDir(tmp_path)
    assert prelaunch_failures.load(state) == []
    found = prelaunch_failures.record(state, failure("3", 100.0))
    assert prelaunch_failures.load(state) == found == [failure("3", 100.0)]
    assert (tmp_path / "early-failures.json").is_file()
    assert prelaunch_failures.latest(found, [90.0]) == failure("3", 100.0)
    assert prelaunch_failures.latest(found, [120.0]) is None
    assert failure("3", 100.0).text() == (
        "before training (SLURM job 3): WorkflowError: task 'x.py': no such file "
        "(log: .snakemake/slurm_logs/rule_train/x/3.log)"
    )
