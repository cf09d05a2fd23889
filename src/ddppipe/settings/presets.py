"""Training recipes. A config's ``train.preset`` fills every recipe key the user left null.

``fast`` depends on the device: a run that trains on GPUs gets the ``gpu`` recipe, and its
resolved config says ``preset: gpu`` (the recipe it trained with). On CPUs its precision is
``auto``: bf16 where the CPUs that train multiply bfloat16 natively, else fp32 (several times
faster on CPUs that only emulate bf16), decided where the ranks start
(:mod:`ddppipe.parallel.precision`), never by the machine that resolves the config: the
resolved config, and so the run's identity, are the same on every machine.
"""

from __future__ import annotations

from typing import Any

AUTO = "auto"  # train.precision decided by the devices that train (ddppipe.parallel.precision)

RECIPE_KEYS = (
    "epochs",
    "batch_size",
    "optimizer",
    "lr",
    "weight_decay",
    "schedule",
    "gamma",
    "precision",
    "channels_last",
    "label_smoothing",
)

PRESETS: dict[str, dict[str, Any]] = {
    # The seeds' classic recipe: Adadelta lr 1.0, StepLR gamma 0.7, batch 64 per rank, 14 epochs.
    # batch_size null here means 64 x world size (the classic per-rank batch).
    "reference": {
        "epochs": 14,
        "batch_size": None,
        "optimizer": "adadelta",
        "lr": 1.0,
        "weight_decay": 0.0,
        "schedule": "step",
        "gamma": 0.7,
        "precision": "fp32",
        "channels_last": False,
        "label_smoothing": 0.0,
    },
    # >= 99.0 % test accuracy on MNIST in one epoch: the BatchNorm variant of the seeds' CNN
    # (TASK_ARGS), after the public single-GPU recipe (tuomaso/train_mnist_fast: one epoch,
    # Adam, one-cycle, no dropout) and CIFAR-10 speedruns (KellerJordan/cifar10-airbench:
    # BatchNorm, label smoothing). bf16 also all-reduces bf16 gradients
    # (ddppipe.training.loop.train).
    # Measured with 2 CPU processes (2026-11-23): 99.14 / 99.13 / 99.10 % for seeds 0 / 1 / 2;
    # a global batch of 256 reached 98.86-99.06 %, and the seeds' CNN as it is 98.57 %.
    "fast": {
        "epochs": 1,
        "batch_size": 128,
        "optimizer": "adamw",
        "lr": 0.006,
        "weight_decay": 0.01,
        "schedule": "onecycle",
        "gamma": 0.7,
        "precision": AUTO,  # bf16 where the training CPUs compute it natively, else fp32
        "channels_last": True,
        "label_smoothing": 0.1,
    },
}

# The fast recipe on GPUs (the whole set already on the device: ddppipe.data.Tensors): a
# global batch of 256, for fewer and larger steps, with a higher peak learning rate, and two
# epochs: on an H200 one epoch gave 99.07 / 98.93 / 99.02 % for seeds 0 / 1 / 2, two epochs
# 99.24 / 99.23 / 99.21 % in 2.7-3.6 s of training (docs/gpus.md, 2026-11-28).
PRESETS["gpu"] = {
    **PRESETS["fast"], "epochs": 2, "batch_size": 256, "lr": 0.01, "precision": "bf16"
}  # fmt: skip

GPU_VERSION = {"fast": "gpu"}  # what a preset becomes on a run that trains on GPUs

# Task arguments a preset sets where the user leaves them unset: the model variant its recipe
# was tuned with (one epoch needs the BatchNorm variant of the seeds' CNN).
TASK_ARGS: dict[str, dict[str, dict[str, Any]]] = {
    "fast": {"ddppipe.tasks.mnist": {"batchnorm": True}},
    "gpu": {"ddppipe.tasks.mnist": {"batchnorm": True}},
}

REFERENCE_BATCH_PER_RANK = 64
# The strategies whose model FSDP2 shards (ddppipe.parallel.fsdp). FSDP2 shards contiguous
# parameters only: a sharded model never takes its preset's channels_last.
SHARDED = ("fsdp", "hsdp")


def chosen(name: str, gpus: bool) -> str:
    """The preset a run trains with: ``name``, or its GPU version on GPUs."""
    return GPU_VERSION.get(name, name) if gpus else name


def resolve(
    train: dict[str, Any], world_size: int, gpus: bool, strategy: str = "ddp"
) -> dict[str, Any]:
    """The train section with its preset chosen for the device (``gpus``: the run trains on
    GPUs) and every recipe key filled from it (``channels_last`` not under a sharded
    ``strategy``: :data:`SHARDED`). Nothing here reads this machine: a precision ``auto`` is
    decided where the ranks start. A key the user set is kept."""
    resolved = {**train, "preset": chosen(train["preset"], gpus)}
    preset = PRESETS[resolved["preset"]]
    for key in RECIPE_KEYS:
        if resolved.get(key) is None:
            resolved[key] = preset[key]
    if train.get("channels_last") is None and strategy in SHARDED:
        resolved["channels_last"] = False
    if resolved["batch_size"] is None:
        resolved["batch_size"] = REFERENCE_BATCH_PER_RANK * world_size
    return resolved


def task_args(preset: str, task: str, args: dict[str, Any]) -> dict[str, Any]:
    """``args`` of ``task`` with the arguments ``preset`` sets where they are unset."""
    return {**TASK_ARGS.get(preset, {}).get(task, {}), **args}
