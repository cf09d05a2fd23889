# Paths and helpers shared by the rules.
import glob
import os

from snakemake.exceptions import WorkflowError
from snakemake.logging import logger

from ddppipe import cluster_policy as ddp_cluster_policy
from ddppipe import container as ddp_container
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


def data_folder(wildcards, input):
    """The folder of the MNIST files a rule reads (its input.data)."""
    return os.path.dirname(input.data[0])


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
            config,
            settings.status_command,
            settings.requeue,
            [f"{run_dir(r)}/state" for r in runs],
        )
    except ddp_cluster_policy.ClusterPolicyError as e:
        raise WorkflowError(str(e)) from None  # shown as a message, without a traceback
    for finding in found:
        logger.warning(f"ddppipe cluster check: {finding}")


# -- the Apptainer image (rule build_image, container.mode) --------------------------------

ROOT = (
    workflow.basedir
)  # the repository root: the recipes' %files paths are relative to it


def image_sources():
    """What the image is built from: recipe, pyproject.toml, the torch pin, the sources."""
    src = os.path.join(ROOT, "src", "ddppipe")
    return {
        "recipe": os.path.join(ROOT, config["container"]["recipe"]),
        "pyproject": os.path.join(ROOT, "pyproject.toml"),
        "constraints": os.path.join(ROOT, "constraints.txt"),
        "sources": sorted(
            glob.glob(f"{src}/**/*.py", recursive=True) + glob.glob(f"{src}/*.yaml")
        ),
    }


def image_input():
    """The image (and its info) as inputs of the rules that run in it; none when mode is none."""
    if not ddp_container.enabled(config):
        return []
    image = config["container"]["image"]
    return [image, str(ddp_container.info_path(image))]


def image_exec():
    """Shell prefix running a rule's command inside the image ('' when mode is none)."""
    return (
        " ".join(ddp_container.exec_prefix(config)) + " "
        if ddp_container.enabled(config)
        else ""
    )


def image_info_arg():
    """`ddppipe export` option recording the image in the provenance."""
    if not ddp_container.enabled(config):
        return ""
    return f"--image-info {ddp_container.info_path(config['container']['image'])}"


def check_gpu_image():
    """A GPU run (container.mode apptainer) needs an image with CUDA: a config error."""
    try:
        ddp_container.check_gpu_image(
            config, image_sources()["recipe"], config["container"]["image"]
        )
    except ddp_container.ContainerError as e:
        raise WorkflowError(str(e)) from None


check_gpu_image()
