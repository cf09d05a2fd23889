"""The table of ``ddppipe`` subcommands: name, help, arguments and the function each calls.

A command's function is named ``"module:function"`` and imported only when that command runs,
so a command that does not train never imports torch. It is called with the parsed arguments
as keywords (each argument's ``dest`` is a parameter name) and returns the exit code.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Arg:
    """One ``add_argument`` call: the option strings (or a positional's name) and options."""

    names: tuple[str, ...]
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class OneOf:
    """A required choice of exactly one of ``args`` (a mutually exclusive group)."""

    args: tuple[Arg, ...]


@dataclass(frozen=True)
class Command:
    """A subcommand: its name, its help line, ``"module:function"`` it calls, its arguments."""

    name: str
    help: str
    call: str
    args: tuple[Arg | OneOf, ...] = ()


def arg(*names: str, **options: Any) -> Arg:
    """An argument: ``add_argument(*names, **options)``."""
    return Arg(names, options)


def one_of(*args: Arg) -> OneOf:
    """A required choice of one of ``args``."""
    return OneOf(args)


def command(name: str, help: str, call: str, *args: Arg | OneOf) -> Command:
    """A table row: the subcommand ``name``, its ``help``, the function it calls, its args."""
    return Command(name, help, call, args)


# --config is a parameter ``config_path`` (``config`` is the module that loads it).
CONFIG = {"dest": "config_path", "metavar": "CONFIG"}
RESOLVED = {**CONFIG, "type": Path, "required": True}
DEVICE = {"choices": ["gpu", "cpu"], "required": True, "help": "the run's device (its spec)"}
PRECISIONS = ["fp32", "bf16", "auto"]  # train.precision (auto: ddppipe.parallel.precision)

COMMANDS: tuple[Command, ...] = (
    command(
        "resolve-config",
        "validate a config, fill in its preset for this machine's device",
        "ddppipe.cli.commands.launching:resolve_config",
        one_of(
            arg("--config", type=Path, help="a config file", **CONFIG),
            arg(
                "--json",
                dest="json_text",
                metavar="JSON",
                help="the config as JSON text (the write_config rule)",
            ),
        ),
        arg(
            "--gpus",
            choices=["yes", "no"],
            help="whether the run trains on GPUs (default: this machine's answer)",
        ),
        arg("--out", type=Path, required=True),
    ),
    command(
        "data-settings",
        "write what a task's data depends on (data rule)",
        "ddppipe.cli.commands.settings:data_settings",
        arg(
            "--json",
            dest="json_text",
            metavar="JSON",
            required=True,
            help="task and task_args as JSON text",
        ),
        arg("--out", type=Path, required=True),
    ),
    command(
        "prepare",
        "run the task's prepare() and write the data manifest",
        "ddppipe.cli.commands.tasks:prepare",
        arg(
            "--settings",
            type=Path,
            required=True,
            help="YAML with task: and task_args: (data rule)",
        ),
        arg("--dest", type=Path, required=True, help="the task's data folder"),
    ),
    command(
        "train",
        "one training process (started by torchrun/srun/mpirun)",
        "ddppipe.cli.ranks:train",
        arg("--config", help="resolved config YAML", **RESOLVED),
        arg("--data", type=Path, required=True, help="folder with the MNIST IDX files"),
        arg(
            "--state",
            type=Path,
            required=True,
            help="run state folder (checkpoints); kept across failed attempts",
        ),
        arg("--checkpoint", type=Path, required=True, help="final checkpoint to write"),
        arg("--metrics", type=Path, required=True, help="per-epoch metrics (JSON lines)"),
    ),
    command(
        "launch",
        "train one slot: torchrun locally, or an srun step in a SLURM job",
        "ddppipe.cli.commands.launching:launch",
        arg("--config", help="resolved config YAML", **RESOLVED),
        arg("--data", type=Path, help="the task's prepared data folder"),
        arg("--state", type=Path, required=True, help="run state folder"),
        arg("--checkpoint", type=Path, help="(task) final checkpoint to write"),
        arg("--outputs", type=Path, help="(script) folder to publish its outputs to"),
        arg("--metrics", type=Path, required=True, help="metrics (JSON lines) to write"),
        arg("--attempts", type=Path, help="attempt history to write once complete"),
        arg(
            "--log",
            type=Path,
            help="the rule's log: a copy of the state's train.log (every slot)",
        ),
    ),
    command(
        # main() runs it before parsing (torchrun's options would be taken): here for --help
        "agent",
        "torchrun on this node, safe from SIGUSR1 (srun starts it)",
        "ddppipe.launching.agent:run_agent",
        arg(
            "torchrun_argv",
            metavar="torchrun_args",
            nargs=argparse.REMAINDER,
            help="torchrun arguments",
        ),
    ),
    command(
        "pack-trial",
        "(train rule of a packed sweep) queue a trial for the sweep's held allocations, wait",
        "ddppipe.cli.commands.packing:pack_trial",
        arg("--pool", type=Path, required=True, help="the sweep's pool folder"),
        arg("--config", help="the trial's resolved config", **RESOLVED),
        arg("--order", type=int, default=0, help="the trial's place in the sweep (0: first)"),
        arg("launch", nargs=argparse.REMAINDER, help="-- and the trial's launch command"),
    ),
    command(
        "pack-worker",
        "(in an allocation, one per node) run a packed sweep's trials in this node's slots",
        "ddppipe.cli.commands.packing:pack_worker",
        arg("--pool", type=Path, required=True, help="the sweep's pool folder"),
        arg("--slots", type=int, required=True, help="trials side by side on this node"),
        arg("--signal-seconds", type=int, required=True, help="warn trials so long before the end"),
        arg("--stop-signal", required=True, help="the signal that warns them (SIGUSR1)"),
        arg("--nproc", type=int, required=True, help="a trial's processes (preflight)"),
        arg("--use", **DEVICE),
        arg("--precision", choices=PRECISIONS, required=True),
    ),
    command(
        "warm-server",
        "import torch once and fork the training processes of later slots (warm ranks)",
        "ddppipe.cli.warm_server:warm_server",
        arg("--socket", type=Path, required=True, help="the Unix socket to listen on"),
        arg(
            "--data-json",
            default="[]",
            help="datasets to keep for the ranks: [{task, data_dir, args}, ...]",
        ),
        arg("--keep-s", type=float, default=0.0, help="seconds it outlives its callers"),
        arg("--caller", type=int, help="the pid of the call it serves (default: its parent)"),
    ),
    command(
        "preflight",
        "check a SLURM job's nodes as a training slot does (before a long queue)",
        "ddppipe.cli.commands.launching:preflight",
        arg("--config", **RESOLVED),
    ),
    command(
        "attempts",
        "print (or write as HTML) a run's attempt history",
        "ddppipe.cli.commands.runstate:attempts",
        arg(
            "--history",
            type=Path,
            required=True,
            help="attempts.json (results/<run>/state/ while it trains, results/<run>/train/ after)",
        ),
        arg("--run", default="run", help="run name for the HTML page's title"),
        arg("--html", type=Path, help="HTML page to write instead of printing"),
    ),
    command(
        "submit",
        "submit the snakemake head as a SLURM job (runs `snakemake ARGS` there, requeues)",
        "ddppipe.cli.commands.slurm:submit",
        arg("--time", default="1-00:00:00", help="the head job's time limit (sbatch --time)"),
        arg("--partition", help="the head job's partition (default: the cluster's)"),
        arg("--account", help="the head job's account"),
        arg("args", nargs=argparse.REMAINDER, help="-- and the snakemake arguments"),
    ),
    command(
        "head",
        "(in the head job) snakemake --unlock, then snakemake; requeue near the time limit",
        "ddppipe.cli.commands.slurm:head",
        arg("args", nargs=argparse.REMAINDER, help="-- and the snakemake arguments"),
    ),
    command(
        "preflight-node",
        "(one per node) resolve the host, check devices",
        "ddppipe.cli.commands.launching:preflight_node",
        arg("--host", help="rendezvous host (default: the step's first node)"),
        arg("--nproc", type=int, default=1, help="training processes on this node"),
        arg("--use", **DEVICE),
        arg("--precision", choices=PRECISIONS, default="fp32"),
    ),
    command(
        "preflight-allreduce",
        "(one per rank, under torchrun) all-reduce, bandwidth and GEMM peak",
        "ddppipe.cli.ranks:preflight_allreduce",
        arg("--use", **DEVICE),
        arg(
            "--precision",
            choices=PRECISIONS,
            default="fp32",
            help="the training's precision (auto: decided by the ranks' devices), for the GEMM "
            "peak",
        ),
        arg("--peak-out", type=Path, help="(rank 0) write the nodes' peaks here (JSON)"),
        arg("--nodes", type=int, default=1, help="the world's nodes (its join timeout grows)"),
    ),
    command(
        "evaluate",
        "evaluate a checkpoint on the test set",
        "ddppipe.cli.commands.reports:evaluate",
        arg("--checkpoint", type=Path, required=True),
        arg("--data", type=Path, required=True),
        arg("--metrics", type=Path, required=True, help="metrics JSON to write"),
        arg(
            "--plot",
            type=Path,
            required=True,
            help="PNG to write: confusion matrix, else metrics",
        ),
        arg("--config", help="the run's resolved config", **RESOLVED),
        arg("--batch-size", type=int, help="default: train.eval_batch_size"),
    ),
    command(
        "export",
        "write the result and its provenance record",
        "ddppipe.cli.commands.training:export",
        arg(
            "--result",
            type=Path,
            required=True,
            help="final weights (model.pt), or a script's outputs",
        ),
        arg("--record", type=Path, help="the final checkpoint's record (final.json)"),
        arg("--config", help="the run's resolved config", **RESOLVED),
        arg("--data", type=Path, help="the task's prepared data folder"),
        arg("--out", type=Path, required=True, help="weights (task) or folder (script)"),
        arg("--provenance", type=Path, required=True),
        arg("--image-info", type=Path, help="JSON describing the container image used"),
        arg("--layer-info", type=Path, help="JSON describing its task layer (requirements)"),
        arg("--attempts", type=Path, help="the run's attempt history (attempts.json)"),
    ),
    command(
        "plot-evaluation",
        "the training's final evaluation: metrics JSON and its figure",
        "ddppipe.cli.commands.reports:plot_evaluation",
        arg("--evaluation", type=Path, required=True, help="train/evaluation.json"),
        arg("--metrics", type=Path, required=True, help="metrics JSON to write"),
        arg("--plot", type=Path, required=True, help="PNG to write"),
    ),
    command(
        "evaluate-logged",
        "a script run's last logged values and plot",
        "ddppipe.cli.commands.reports:evaluate_logged",
        arg("--metrics", type=Path, required=True, help="metrics.jsonl of job.log"),
        arg("--out", type=Path, required=True, help="metrics JSON to write"),
        arg("--plot", type=Path, required=True, help="PNG to write"),
    ),
    command(
        "build-image",
        "build the Apptainer image (atomically) and its info",
        "ddppipe.cli.commands.apptainer:build_image",
        arg("--recipe", type=Path, required=True, help="Apptainer definition file"),
        arg("--image", type=Path, required=True, help=".sif to write"),
        arg("--info", type=Path, required=True, help="image-info JSON (sha256, labels)"),
        arg("--log", type=Path, required=True, help="apptainer build output"),
        arg(
            "--context",
            type=Path,  # default (None): the current folder
            help="folder the recipe's %%files paths are relative to (repository root)",
        ),
    ),
    command(
        "build-task-layer",
        "install pinned pip packages over the image into a SquashFS layer, and its info",
        "ddppipe.cli.commands.apptainer:build_task_layer",
        arg("--base", type=Path, required=True, help="the ddppipe image to install over"),
        arg("--layer", type=Path, required=True, help=".layer.sqfs to write"),
        arg("--info", type=Path, required=True, help="layer-info JSON (sha256, installed)"),
        arg("--log", type=Path, required=True, help="pip's and mksquashfs's output"),
        arg("requirements", nargs="+", help="pinned pip requirements (name==version)"),
    ),
    command(
        "image-info",
        "write the info JSON (sha256, labels) of an image",
        "ddppipe.cli.commands.apptainer:image_info",
        arg("--image", type=Path, required=True),
        arg("--recipe", type=Path, required=True),
        arg("--out", type=Path, required=True),
    ),
    command(
        "plot-training",
        "plot per-epoch loss and accuracy",
        "ddppipe.cli.commands.reports:plot_training",
        arg("--metrics", type=Path, required=True),
        arg("--out", type=Path, required=True),
    ),
    command(
        "plot-scaling",
        "figures and time-to-accuracy table of the scaling study",
        "ddppipe.cli.commands.reports:plot_scaling",
        arg(
            "--metrics",
            type=Path,
            nargs="+",
            required=True,
            help="metrics.jsonl of each grid point",
        ),
        arg(
            "--configs",
            type=Path,
            nargs="+",
            required=True,
            help="resolved config.yaml of each grid point, in the same order",
        ),
        arg(
            "--targets",
            type=float,
            nargs="+",
            default=[0.98, 0.99],
            help="test accuracies (fractions) to tabulate the time to",
        ),
        arg("--curves", type=Path, required=True, help="learning-curves PNG to write"),
        arg(
            "--throughput",
            type=Path,
            required=True,
            help="throughput and efficiency PNG to write",
        ),
        arg("--table-csv", type=Path, required=True),
        arg("--table-html", type=Path, required=True),
    ),
    command(
        "sweep-trials",
        "write a sweep's definition and trials (results/sweeps/<name>/sweep.json)",
        "ddppipe.cli.commands.sweeps:sweep_trials",
        arg("--config-json", required=True, help="the workflow's config as JSON text"),
        arg("--out", type=Path, required=True),
    ),
    command(
        "sweep-table",
        "a sweep's table (one row per trial), best trial and TensorBoard HParams",
        "ddppipe.cli.commands.sweeps:sweep_table",
        arg("--sweep", dest="sweep_path", type=Path, required=True, help="its sweep.json"),
        arg("--csv", type=Path, required=True, help="trials.csv to write"),
        arg("--best", type=Path, required=True, help="best.json to write"),
    ),
    command(
        "plot-sweep",
        "a sweep's figures: metric against each parameter, learning curves, parallel coordinates",
        "ddppipe.cli.commands.sweeps:plot_sweep",
        arg("--sweep", dest="sweep_path", type=Path, required=True, help="its sweep.json"),
        arg("--out-dir", type=Path, required=True, help="the figures' folder"),
    ),
    command(
        "sweep-round",
        "suggest a model-based sweep's round of trials (results/sweeps/<name>/rounds/<k>.json)",
        "ddppipe.cli.commands.sweeps:sweep_round",
        arg("--config-json", required=True, help="the workflow's config as JSON text"),
        arg("--round", type=int, required=True, help="the round's number, from 0"),
        arg("--out", type=Path, required=True),
    ),
    command(
        "summary",
        "a run's summary: accuracy, targets, speed, attempts",
        "ddppipe.cli.commands.reports:summary",
        arg("run", help="run name (results/<run>)"),
        arg("--results", type=Path, default=Path("results"), help="results folder"),
        arg("--html", type=Path, help="write it as an HTML fragment here (the report's)"),
    ),
    command(
        "reproduce",
        "train a finished run again from its record; say whether it came out the same",
        "ddppipe.cli.commands.reproduce:reproduce",
        arg("path", type=Path, help="a run folder, its export/provenance.json or model.pt"),
        arg("--data", type=Path, help="the prepared data (default: found under resources/)"),
    ),
    command(
        "selfcheck",
        "print versions and run a one-process DDP smoke test",
        "ddppipe.cli.commands.training:selfcheck",
    ),
    command(
        "time-loader",
        "time one rank's data loader alone, as the run's training reads its batches",
        "ddppipe.cli.commands.training:time_loader",
        arg("--config", help="the run's resolved config (results/<run>/config.yaml)", **RESOLVED),
        arg("--data", type=Path, required=True, help="the data folder (or its staged copy)"),
        arg("--steps", type=int, default=50, help="batches to read (default 50; 2 or more)"),
        arg("--world-size", type=int, help="default: the config's nodes x processes a node"),
        arg("--rank", type=int, default=0, help="the rank whose share is read (default 0)"),
    ),
)
