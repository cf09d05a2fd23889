import os

import pytest

from ddppipe.core import rendezvous
from ddppipe.parallel import environments as envs


def test_torchrun() -> None:
    env = {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "MASTER_ADDR": "node1",
        "MASTER_PORT": "29400",
        "TORCHELASTIC_RUN_ID": "x",
        # torchrun under srun: SLURM variables are present too and must lose
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NTASKS": "2",
    }
    e = envs.detect(env)
    assert isinstance(e, envs.TorchElastic)
    assert (e.rank, e.local_rank, e.world_size) == (3, 1, 4)
    assert (e.master_addr, e.master_port) == ("node1", 29400)


def test_slurm_srun_first_host_and_job_port() -> None:
    env = {
        "SLURM_PROCID": "5",
        "SLURM_LOCALID": "1",
        "SLURM_NTASKS": "8",
        "SLURM_STEP_NUM_TASKS": "6",
        "SLURM_JOB_NODELIST": "gpu[07-09],cpu1",
        "SLURM_JOB_ID": "123456",
    }
    e = envs.detect(env)
    assert isinstance(e, envs.Slurm)
    assert (e.rank, e.local_rank, e.world_size) == (5, 1, 6)  # the step's tasks win
    assert e.master_addr == "gpu07"
    assert e.master_port == rendezvous.job_port(123456)
    other = envs.detect({**env, "SLURM_JOB_ID": "123457"})
    assert other.master_port != e.master_port
    # A step on a subset of the job's nodes meets on the step's first node.
    step = envs.detect({**env, "SLURM_STEP_NODELIST": "gpu[08-09]"})
    assert step.master_addr == "gpu08"


def test_slurm_explicit_master_overrides() -> None:
    env = {
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_JOB_NODELIST": "n[1-2]",
        "SLURM_JOB_ID": "7",
        "MASTER_ADDR": "10.0.0.5",
        "MASTER_PORT": "1234",
    }
    e = envs.detect(env)
    assert (e.master_addr, e.master_port) == ("10.0.0.5", 1234)


def test_openmpi_inside_slurm_allocation() -> None:
    env = {
        "OMPI_COMM_WORLD_RANK": "2",
        "OMPI_COMM_WORLD_LOCAL_RANK": "0",
        "OMPI_COMM_WORLD_SIZE": "4",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NTASKS": "1",
        "SLURM_JOB_NODELIST": "a[3-4]",
    }
    e = envs.detect(env)
    assert isinstance(e, envs.OpenMPI)
    assert (e.rank, e.local_rank, e.world_size, e.master_addr) == (2, 0, 4, "a3")
    assert e.master_port == 29500  # torchrun's default: no MASTER_PORT given


def test_pmi() -> None:
    env = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MASTER_ADDR": "h0"}
    e = envs.detect(env)
    assert isinstance(e, envs.PMI)
    assert (e.rank, e.local_rank, e.world_size, e.master_addr) == (1, 1, 2, "h0")


def test_mpi_without_rendezvous_host_is_a_clear_error() -> None:
    e = envs.detect(
        {
            "OMPI_COMM_WORLD_RANK": "0",
            "OMPI_COMM_WORLD_LOCAL_RANK": "0",
            "OMPI_COMM_WORLD_SIZE": "2",
        }
    )
    with pytest.raises(envs.LauncherEnvError, match="MASTER_ADDR"):
        _ = e.master_addr


def test_single_process() -> None:
    e = envs.detect({})
    assert isinstance(e, envs.Single)
    assert (e.rank, e.local_rank, e.world_size, e.master_addr) == (0, 0, 1, "127.0.0.1")


def test_bad_values_are_clear_errors() -> None:
    with pytest.raises(envs.LauncherEnvError, match="RANK='x' is not an integer"):
        envs.detect(
            {
                "RANK": "x",
                "LOCAL_RANK": "0",
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "a",
                "MASTER_PORT": "1",
                "TORCHELASTIC_RUN_ID": "1",
            }
        )
    with pytest.raises(envs.LauncherEnvError, match="outside world size"):
        envs.detect({"PMI_RANK": "2", "PMI_SIZE": "2", "PMI_LOCAL_RANK": "0"})
    with pytest.raises(rendezvous.NodelistError, match="node list"):
        rendezvous.first_host("node[3-")


def test_a_gpu_rank_without_its_nodes_process_count_is_a_clear_error(monkeypatch) -> None:
    """PMI without MPI_LOCALNRANKS: local rank 1 of a GPU run cannot tell its GPU and CPUs
    (it raised KeyError while binding its CPUs): a clear error before it picks a device."""
    from ddppipe.parallel import distributed

    for key in [k for k in os.environ if k.startswith(("SLURM_", "OMPI_", "PMI_", "MPI_"))]:
        monkeypatch.delenv(key)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("PMI_RANK", "1")
    monkeypatch.setenv("PMI_SIZE", "2")
    monkeypatch.setenv("MPI_LOCALRANKID", "1")
    with pytest.raises(envs.LauncherEnvError) as refused:
        distributed.setup("gpu")
    assert str(refused.value).startswith(
        "pmi: the launcher of rank 1 does not say how many processes its node runs, and a GPU "
        "rank needs that to take a GPU and CPUs of its own: set it where the launcher puts it "
        "(pmi: MPI_LOCALNRANKS or PMI_LOCAL_SIZE;"
    )
