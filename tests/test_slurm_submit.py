"""Golden tests of the SLURM request: the plugin's own sbatch line for the train rule."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from snakemake_executor_plugin_slurm.submit_string import get_submit_command
from snakemake_executor_plugin_slurm.utils import set_gres_string

from ddppipe.settings import config
from ddppipe.settings import run_spec as run_spec
from ddppipe.slurm import request as slurm_request
from ddppipe.slurm import scontrol
from tests.tiny import REPO, default_config

PROFILE = yaml.safe_load((REPO / "profiles" / "slurm" / "config.yaml").read_text())
PARAMS = {
    "run_uuid": "RUN",
    "slurm_logfile": "LOG",
    "comment_str": "rule_train_wildcards_mnist",
    "account": "",
    "partition": "",
    "workdir": "/work",
}


class Resources(dict):
    """What the plugin expects of ``job.resources``: a mapping with attribute access."""

    def __getattr__(self, name: str) -> Any:
        return self[name]


def sbatch_line(cfg: dict[str, Any]) -> str:
    """The plugin's sbatch line for ``cfg``, which trains on GPUs where it asks for them."""
    gpus = cfg["launch"]["device"] == "gpu"
    res = Resources(
        {
            **PROFILE["default-resources"],
            **slurm_request.Request.from_spec(run_spec.resolve(cfg, gpus=gpus)).resources(),
        }
    )
    job = SimpleNamespace(resources=res, threads=cfg["launch"]["nproc_per_node"])
    # The plugin appends the GRES flag right after the submit command (run_job).
    settings = SimpleNamespace(requeue=PROFILE["slurm-requeue"], no_requeue=False, qos=None,
                               reservation=None)  # fmt: skip
    return get_submit_command(job, PARAMS, settings) + set_gres_string(job)


def test_default_profile_and_config() -> None:
    assert sbatch_line(default_config()) == (
        "sbatch --parsable --job-name RUN --output LOG --export=ALL"
        " --comment rule_train_wildcards_mnist   -t 30 --mem 3400 --nodes=1 --requeue"
        " --ntasks=1 --cpus-per-task=2 --ntasks-per-node=1 -D /work"
    )


def test_two_nodes_with_gpus() -> None:
    cfg = default_config()
    cfg["launch"]["nnodes"] = 2
    cfg["launch"]["cpus_per_proc"] = 3
    cfg["launch"]["device"] = "gpu"  # one GPU per process: 2 a node
    cfg["slurm"].update(partition="debug", qos="hi", constraint="a100",
                        account="proj")  # fmt: skip
    res = slurm_request.Request.from_spec(run_spec.resolve(cfg, gpus=True)).resources()
    assert res["mpi"] == 0  # the jobstep runs the rule in the batch step (see Request)
    assert res["slurm_partition"] == "debug" and res["slurm_account"] == "proj"
    assert sbatch_line(cfg) == (
        "sbatch --parsable --job-name RUN --output LOG --export=ALL"
        " --comment rule_train_wildcards_mnist   -t 30 -C a100 --qos=hi --mem 16000 --nodes=2"
        " --requeue --cpus-per-task=6 --ntasks-per-node=1"
        " -D /work --gres=gpu:2"  # GPU jobs: 2 tasks from --nodes=2 x --ntasks-per-node=1
    )


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        (
            {"launch": {"device": "gpu", "nproc_per_node": 4}, "slurm": {"mem_mb": 8000}},
            slurm_request.SlurmRequestError,
            "too little for 4 GPU processes",
        ),
        (
            {"launch": {"nnodes": 3}, "train": {"batch_size": 64}},
            config.ConfigError,  # found where the run is resolved, before any request
            "divisible by the world size 6",
        ),
    ],
)
def test_bad_requests_fail_before_submitting(change: dict, error: type, message: str) -> None:
    cfg = default_config()
    for section, values in change.items():
        cfg[section].update(values)
    with pytest.raises(error, match=message):
        gpus = cfg["launch"]["device"] == "gpu"  # as the config asks: the case's point
        slurm_request.Request.from_spec(run_spec.resolve(cfg, gpus=gpus))


def test_parse_nodelist() -> None:
    line = "JobId=7 JobName=x NodeList=node[1-2] BatchHost=node1"
    assert scontrol.parse_nodelist(line) == ["node1", "node2"]
