# Paths and helpers shared by the rules.
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
        f"results/{RUN}/export/model.pt",
        f"results/{RUN}/export/provenance.json",
    ]
