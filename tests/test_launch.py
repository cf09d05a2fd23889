"""The launch plan (local or SLURM, from the environment) and the CPU threads it uses."""

from __future__ import annotations

import sys

import pytest

from ddppipe.apptainer import running
from ddppipe.launching import launch, slot_machine
from ddppipe.settings import config
from ddppipe.settings import run_spec as run_spec
from ddppipe.slurm import request as slurm_request
from tests.tiny import default_config


def test_threads_are_configured_or_the_cpus_shared_out() -> None:
    cfg = default_config()
    cfg["launch"].update(nproc_per_node=2, cpus_per_proc=None)
    request = slurm_request.Request.from_spec(run_spec.resolve(cfg, gpus=False))
    assert request.threads(16) == 8
    assert request.threads(1) == 1  # never zero threads
    assert request.cpus_per_node == 2  # SLURM asks for 1 CPU per process when unset
    cfg["launch"]["cpus_per_proc"] = 3
    request = slurm_request.Request.from_spec(run_spec.resolve(cfg, gpus=False))
    assert (request.threads(16), request.cpus_per_node) == (3, 6)


def test_job_threads_count_every_process_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = default_config()
    cfg["launch"].update(nproc_per_node=2, cpus_per_proc=3)
    assert launch.job_threads(run_spec.resolve(cfg, gpus=False)) == 6
    cfg["launch"]["cpus_per_proc"] = None  # the CPUs this process may use, shared out
    monkeypatch.setenv("SLURM_CPUS_ON_NODE", "7")  # SLURM's allocation on this node
    assert launch.job_threads(run_spec.resolve(cfg, gpus=False)) == 6  # 3 each, one CPU idle
    monkeypatch.setenv("SLURM_CPUS_ON_NODE", "1")
    assert launch.job_threads(run_spec.resolve(cfg, gpus=False)) == 2  # never 0 threads: 1 each


def test_outside_slurm_the_launcher_starts_each_rank_itself() -> None:
    cfg = default_config()
    cfg["launch"].update(nproc_per_node=3, max_restarts=1)
    cfg["train"]["batch_size"] = 96
    spec = run_spec.resolve(cfg, gpus=False)
    plan = launch.plan(spec, ["train", "--config=c.yaml"], running.python_command(spec),
                       env={"PATH": "/bin"})  # fmt: skip
    assert plan.job is None and plan.workers == 3
    assert plan.command == [sys.executable, "-m", "ddppipe", "train", "--config=c.yaml"]
    assert plan.env["TORCH_GLOO_LAZY_INIT"] == "1"  # (every rank's: workers.rank_environment)


def test_inside_slurm_even_one_node_is_an_srun_step() -> None:
    """Local or SLURM comes from the environment, not from the node count."""
    cfg = default_config()
    cfg["launch"].update(nnodes=1, nproc_per_node=2, cpus_per_proc=2)
    plan = launch.plan(
        run_spec.resolve(cfg, gpus=False),
        ["train"],
        ["python"],
        env={"SLURM_JOB_ID": "42"},
        hosts=["cn07"],
    )
    assert plan.job == "42" and plan.command[0] == "srun"
    assert "--cpus-per-task=4" in plan.command and "--rdzv-id=42" in plan.command
    assert (plan.env["OMP_NUM_THREADS"], plan.env["MKL_NUM_THREADS"]) == ("2", "2")
    assert plan.env["TORCH_GLOO_LAZY_INIT"] == "1"  # (srun's, so every node's ranks')


def test_several_nodes_outside_slurm_is_a_clear_error() -> None:
    cfg = default_config()
    cfg["launch"]["nnodes"] = 2
    with pytest.raises(config.ConfigError, match="no SLURM allocation"):
        launch.plan(run_spec.resolve(cfg, gpus=False), ["train"], [], env={})


def test_a_job_of_another_size_is_refused() -> None:
    cfg = default_config()
    cfg["launch"]["nnodes"] = 2
    with pytest.raises(slurm_request.SlurmRequestError, match="has 1 node"):
        launch.plan(
            run_spec.resolve(cfg, gpus=False),
            ["train"],
            [],
            env={"SLURM_JOB_ID": "7"},
            hosts=["a01"],
        )


def test_launched_processes_get_the_same_omp_and_mkl_threads_and_lazy_gloo() -> None:
    """Snakemake exports MKL_NUM_THREADS = the job's threads; torch would let it win. Gloo
    connects lazily unless the user said otherwise."""
    env = launch.process_environment(2, {"MKL_NUM_THREADS": "8"})
    assert (env["OMP_NUM_THREADS"], env["MKL_NUM_THREADS"]) == ("2", "2")
    assert env["TORCH_GLOO_LAZY_INIT"] == "1"
    kept = launch.process_environment(2, {"TORCH_GLOO_LAZY_INIT": "0"})
    assert kept["TORCH_GLOO_LAZY_INIT"] == "0"


STOPPED = {"signal": "SIGUSR1", "checkpoint": "ckpt-e0002-s000040.pt"}
UNFINISHED = {"signal": None, "checkpoint": None, "unfinished": ["cn08"]}


@pytest.mark.parametrize(("code", "note", "seen_lost", "asked"), [
    (0, None, True, False),  # every rank finished, a node lost after: finished stays finished
    (0, None, False, False),
    (0, UNFINISHED, False, True),  # exit 0 but cn08's finished mark missing: SLURM asked
    (0, UNFINISHED, True, True),
    (1, None, False, True),  # the step failed: a lost node may be why
    (137, None, True, True),
    (75, STOPPED, False, True),
    (0, STOPPED, True, True),  # stopped on a signal, not finished: the lost node counts
])  # fmt: skip
def test_a_lost_node_ends_a_slot_only_when_it_did_not_finish(
    code: int, note: dict | None, seen_lost: bool, asked: bool
) -> None:
    """(the step's exit, its stop note, a node seen lost) -> whether the slot's end is a lost
    node's (SLURM asked): never once every rank finished."""
    assert slot_machine.may_be_lost(code, note, seen_lost) is asked
