# Paths and helpers shared by the rules.
from snakemake.exceptions import WorkflowError
from snakemake.logging import logger

from ddppipe import cluster_policy as ddp_cluster_policy
from ddppipe import launch as ddp_launch
from ddppipe import scaling as ddp_scaling
from ddppipe import slurm as ddp_slurm

RUN = config["run"]
DATA = "resources/mnist"
MNIST_FILES = [
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
]


def run_dir(run):
    return f"results/{run}"


def all_outputs():
    return [
        f"results/{RUN}/eval/metrics.json",
        f"results/{RUN}/eval/confusion_matrix.png",
        f"results/{RUN}/train/training_curves.png",
        f"results/{RUN}/train/attempts.html",
        f"results/{RUN}/export/model.pt",
        f"results/{RUN}/export/provenance.json",
    ]


def check_cluster_policy():
    """Before the SLURM executor submits anything: fail (or warn) on cluster settings that
    would hang the workflow or lose work (ddppipe.cluster_policy)."""
    if workflow.executor_plugin.name != "slurm":
        return
    settings = workflow.executor_settings
    runs = [RUN, *ddp_scaling.run_names(config)]
    try:
        found = ddp_cluster_policy.check_cluster(
            config, settings.status_command, settings.requeue, [f"{run_dir(r)}/state" for r in runs]
        )
    except ddp_cluster_policy.ClusterPolicyError as e:
        raise WorkflowError(str(e)) from None  # shown as a message, without a traceback
    for finding in found:
        logger.warning(f"ddppipe cluster check: {finding}")
