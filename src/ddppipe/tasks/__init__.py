"""Tasks: what a run trains (model, data, loss, metrics), selected by the ``task:`` config key.

A task is a Python file (``tasks/cifar.py``, relative to the working directory) or an
importable module (``mypkg.tasks.cifar``); the built-in ones live in this package
(``ddppipe.tasks.mnist``, ``ddppipe.tasks.digits``, ``ddppipe.tasks.imagefolder``,
``ddppipe.tasks.charlm``). Its
functions are the contract (``args`` is the config's ``task_args`` mapping)::

    def prepare(data_dir: Path, args: dict) -> None      # once, on the submitting machine
    def datasets(data_dir: Path, args: dict) -> tuple[train, test]
    def model(args: dict) -> torch.nn.Module

Optional: ``loss(output, target) -> Tensor`` (the batch mean; default cross-entropy with
``train.label_smoothing``), ``metrics(output, target) -> dict[str, Tensor]`` (sums over the
batch's samples, all-reduced and divided by the test-set size; default: loss, accuracy and
the confusion matrix), ``optimizer(params, args) -> Optimizer`` (default: ``train.optimizer``),
``ARGS_SCHEMA`` (a JSON schema of ``task_args``; validated, coerced from ``--config``
text and filled with its defaults before anything runs) and ``PREPARE_ARGS`` (the names of
the ``task_args`` that ``prepare`` reads: runs that differ in them get data prepared for
their own values, :mod:`ddppipe.tasks.prepare_args`) and ``FOLDER_ARG`` (the ``task_args``
key naming the folder of files ``datasets`` reads, which ``data.pack: squashfs`` packs into
one image: :mod:`ddppipe.data.squashfs`).

For ``launch.strategy: fsdp`` the model's blocks are sharded one by one: the model may name
them in a ``shard_blocks`` attribute (its submodules, or their names); without it they are the
modules of its ``nn.ModuleList``s, else its children with parameters
(:mod:`ddppipe.parallel.fsdp`).

``datasets`` returns map-style torch Datasets of ``(input, target)`` (read through a
sharded, resumable sampler and DataLoader workers), :class:`ddppipe.data.Tensors` for
data small enough to live in memory (indexed on the device, no per-sample Python),
:class:`ddppipe.data.packed.Packed` (samples decoded once into one file, read memory-mapped)
or :class:`ddppipe.data.shards.Sharded` (samples in tar shards written by ``prepare``,
streamed in file order: data larger than a node's memory or disk).
"""

from ddppipe.tasks.loading import (
    MOVED_MODULES,
    OPTIONAL,
    REQUIRED,
    Source,
    Task,
    TaskError,
    check_model,
    is_file_ref,
    load,
    locate,
    locate_script,
    missing_package_error,
    parameter_count,
    validate_args,
    where_this_runs,
)

__all__ = [
    "MOVED_MODULES",
    "OPTIONAL",
    "REQUIRED",
    "Source",
    "Task",
    "TaskError",
    "check_model",
    "is_file_ref",
    "load",
    "locate",
    "locate_script",
    "missing_package_error",
    "parameter_count",
    "validate_args",
    "where_this_runs",
]
