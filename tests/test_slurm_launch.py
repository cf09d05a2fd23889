"""Golden test of the multinode launch command (a pure function of config and job)."""

from __future__ import annotations

import sys

from ddppipe import launch
from tests.tiny import default_config


def test_srun_torchrun_command() -> None:
    cfg = default_config()
    cfg["launch"].update(nnodes=2, max_restarts=3)
    cfg["slurm"].update(gpus_per_node=2)
    command = launch.slurm_torchrun(cfg, "1234", ["node1", "node2"], ["train", "--config=c"])
    assert command == [
        "srun", "--jobid=1234", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1",
        "--cpus-per-task=2", "--kill-on-bad-exit=1", "--export=ALL", "--gres=gpu:2",
        sys.executable, "-m", "ddppipe", "agent", "--nnodes=2", "--nproc-per-node=2",
        "--rdzv-backend=c10d", "--rdzv-endpoint=node1:16234", "--rdzv-id=1234",
        "--rdzv-conf=join_timeout=120", "--max-restarts=3", "-m", "ddppipe", "train", "--config=c",
    ]  # fmt: skip


def test_rendezvous_host_override() -> None:
    cfg = default_config()
    cfg["slurm"]["rendezvous_host"] = "ib-node1"
    assert launch.rendezvous_endpoint(cfg, "7", ["node1"]) == "ib-node1:15007"
