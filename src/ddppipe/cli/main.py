"""The ``ddppipe`` command: one subcommand per pipeline step, called by the Snakemake rules."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from ddppipe import __version__
from ddppipe.cli.subcommands import COMMANDS, Arg, Command, OneOf
from ddppipe.core import env_names
from ddppipe.core import process_times as _entered  # noqa: F401 (the command began)
from ddppipe.core.errors import UserError
from ddppipe.launching import warm_client


def _setup_logging() -> None:
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


# The thread counts Snakemake exports to a rule's command (its `threads:`).
THREAD_VARIABLES = ("OMP_NUM_THREADS", "GOTO_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                    "MKL_NUM_THREADS", "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")  # fmt: skip


def _one_thread_for_threads_0() -> None:
    """A rule declared with ``threads: 0`` (it holds no core: a little Python beside a
    training) gets these variables as 0, which libgomp rejects with a warning when torch
    loads: such a command runs one thread."""
    for name in THREAD_VARIABLES:
        if os.environ.get(name) == "0":
            os.environ[name] = "1"


def _add(p: argparse.ArgumentParser | argparse._MutuallyExclusiveGroup, one: Arg) -> None:
    p.add_argument(*one.names, **one.options)


def parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand in :data:`ddppipe.cli.subcommands.COMMANDS`."""
    ap = argparse.ArgumentParser(prog="ddppipe", description=__doc__)
    ap.add_argument("--version", action="version", version=f"ddppipe {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        p = sub.add_parser(command.name, help=command.help)
        for one in command.args:
            if isinstance(one, OneOf):
                group = p.add_mutually_exclusive_group(required=True)
                for each in one.args:
                    _add(group, each)
            else:
                _add(p, one)
    return ap


def _call(command: Command, args: argparse.Namespace) -> int:
    """Import the command's function and call it with the parsed arguments as keywords."""
    module, _, name = command.call.partition(":")
    function = getattr(importlib.import_module(module), name)
    return function(**{k: v for k, v in vars(args).items() if k != "command"})


# Subcommands that start or supervise processes of their own (or are one, under a launcher):
# they run here. Every other runs in a process forked by the warm server when one serves this
# machine (ddppipe.launching.warm): its imports (torch, matplotlib) are done.
COLD = frozenset({"launch", "agent", "warm-server", "train", "submit", "head", "preflight",
                  "pack-trial", "pack-worker",
                  "preflight-node", "preflight-allreduce", "build-image", "build-task-layer",
                  "selfcheck", "reproduce"})  # fmt: skip

# Subcommands that import neither torch nor matplotlib (a task's prepare: what its file does):
# forked by a warm server that already listens, else run here at once, never waiting for one
# that is still importing (the rules before training run while it starts).
LIGHT = frozenset({"data-settings", "prepare", "attempts", "summary", "export", "sweep-trials",
                   "sweep-table", "sweep-round"})  # fmt: skip


# The commands of the rules that run beside a training, holding no core of their own (`threads:
# 0`: plots, the attempt page, export, the summary): at a lower CPU priority, so the training
# whose cores they share keeps its speed and they take what it leaves idle.
BESIDE_TRAINING = frozenset({"plot-evaluation", "evaluate-logged", "plot-training", "attempts",
                             "export", "summary"})  # fmt: skip
BESIDE_NICE = 10

# Subcommands that import torch or matplotlib, write their outputs whole before they return and
# need no exit handler: they exit at once, without the interpreter's finalization (with torch
# loaded, 2.5-8.3 s under load against 0.1-0.3 s; a cold `write_config` paid it on SLURM).
EXIT_AT_ONCE = frozenset({"resolve-config", "plot-evaluation", "plot-training", "evaluate-logged",
                          "plot-scaling", "plot-sweep"})  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    entry = argv is None  # this process's command (not a call inside another program)
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in BESIDE_TRAINING:
        os.nice(BESIDE_NICE)  # (a warm server's fork takes its caller's priority)
    if argv and argv[0] not in COLD and os.environ.get(env_names.WARM_SOCKET):
        code = warm_client.delegate(argv, wait=argv[0] not in LIGHT)
        if code is not None:
            return code
    if argv[:1] == ["agent"]:  # torchrun's own options follow; argparse would take them
        import signal

        from ddppipe.parallel import node_check
        from ddppipe.runstate import preemption

        # First, before torch loads (seconds on a busy node): the time-limit warning may come
        # while the agent starts, and would kill it (agent.run_agent says why it is ignored).
        # (A node that cannot read the slot record says so in its checks, and ends there.)
        if node_check.slot_problem() is None:
            signal.signal(preemption.stop_signal(), signal.SIG_IGN)
        from ddppipe.launching import agent

        return agent.run_agent(argv[1:])
    args = parser().parse_args(argv)
    _one_thread_for_threads_0()
    _setup_logging()
    try:
        code = _call(next(c for c in COMMANDS if c.name == args.command), args)
    except (UserError, FileNotFoundError) as e:
        # Known failure modes carry actionable messages; show them without a traceback.
        print(f"ddppipe {args.command}: error: {e}", file=sys.stderr)
        code = 2
    if entry and args.command in EXIT_AT_ONCE:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 0)
    return code
