"""The ``ddppipe`` command: one subcommand per pipeline step, called by the Snakemake rules."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from ddppipe import __version__


def _setup_logging() -> None:
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def _train_paths(args: argparse.Namespace):
    from ddppipe.train import Paths

    return Paths(args.data, args.state, args.checkpoint, args.metrics)


def cmd_resolve_config(args: argparse.Namespace) -> int:
    from ddppipe import config

    config.write(config.resolve(config.load(args.config)), args.out)
    return 0


def cmd_download(args: argparse.Namespace) -> int:
    from ddppipe import config, download

    cfg = config.load(args.config)
    download.download_all(
        cfg["data"]["sha256"], cfg["data"]["mirrors"], args.dest, cfg["data"]["timeout_s"]
    )
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from ddppipe import config, preemption, train

    cfg = config.load(args.config)
    try:
        train.train(cfg, _train_paths(args))
    except preemption.Preempted as e:
        logging.getLogger("ddppipe").warning("%s", e)
        return preemption.EXIT_CODE
    return 0


def cmd_launch(args: argparse.Namespace) -> int:
    from ddppipe import config, launch

    cfg = config.load(args.config)
    train_args = launch.train_args(
        args.config, args.data, args.state, args.checkpoint, args.metrics
    )
    command = launch.local_torchrun(cfg, train_args)
    env = launch.environment(cfg, launch.available_cpus())
    logging.getLogger("ddppipe").info("exec: %s", " ".join(command))
    launch.exec_command(command, env)
    return 0  # not reached


def cmd_evaluate(args: argparse.Namespace) -> int:
    from ddppipe import atomic, evaluate, plots

    result = evaluate.evaluate_checkpoint(args.checkpoint, args.data, args.batch_size)
    atomic.write_json(args.metrics, result)
    plots.confusion_matrix(result["confusion_matrix"], result["test_accuracy"], args.plot)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from ddppipe import atomic, checkpoint, provenance

    snapshot = checkpoint.load(args.checkpoint)
    with atomic.atomic_path(args.weights) as tmp:
        import torch

        torch.save(snapshot["model"], tmp)
    image = json.loads(Path(args.image_info).read_text()) if args.image_info else None
    atomic.write_json(args.provenance, provenance.record(snapshot, args.data, image))
    return 0


def cmd_plot_training(args: argparse.Namespace) -> int:
    from ddppipe import plots

    history = [json.loads(line) for line in args.metrics.read_text().splitlines() if line]
    plots.training_curves(history, args.out)
    return 0


def cmd_selfcheck(args: argparse.Namespace) -> int:
    from ddppipe import selfcheck

    print(json.dumps(selfcheck.run(), indent=2))
    return 0


def _add_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, required=True, help="resolved config YAML")
    p.add_argument("--data", type=Path, required=True, help="folder with the MNIST IDX files")
    p.add_argument(
        "--state",
        type=Path,
        required=True,
        help="run state folder (checkpoints); kept across failed attempts",
    )
    p.add_argument("--checkpoint", type=Path, required=True, help="final checkpoint to write")
    p.add_argument("--metrics", type=Path, required=True, help="per-epoch metrics (JSON lines)")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ddppipe", description=__doc__)
    ap.add_argument("--version", action="version", version=f"ddppipe {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("resolve-config", help="validate a config and fill in its preset")
    p.add_argument("--config", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(func=cmd_resolve_config)

    p = sub.add_parser("download", help="download and verify the MNIST IDX files")
    p.add_argument("--config", type=Path, required=True)
    p.add_argument("--dest", type=Path, required=True)
    p.set_defaults(func=cmd_download)

    p = sub.add_parser("train", help="one training process (started by torchrun/srun/mpirun)")
    _add_train_args(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("launch", help="start torchrun for this node with the configured processes")
    _add_train_args(p)
    p.set_defaults(func=cmd_launch)

    p = sub.add_parser("evaluate", help="evaluate a checkpoint on the test set")
    p.add_argument("--checkpoint", type=Path, required=True)
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--metrics", type=Path, required=True, help="metrics JSON to write")
    p.add_argument("--plot", type=Path, required=True, help="confusion-matrix PNG to write")
    p.add_argument("--batch-size", type=int, default=1000)
    p.set_defaults(func=cmd_evaluate)

    p = sub.add_parser("export", help="write final weights and a provenance record")
    p.add_argument("--checkpoint", type=Path, required=True)
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--weights", type=Path, required=True)
    p.add_argument("--provenance", type=Path, required=True)
    p.add_argument("--image-info", type=Path, help="JSON describing the container image used")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("plot-training", help="plot per-epoch loss and accuracy")
    p.add_argument("--metrics", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(func=cmd_plot_training)

    p = sub.add_parser("selfcheck", help="print versions and run a one-process DDP smoke test")
    p.set_defaults(func=cmd_selfcheck)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    _setup_logging()
    try:
        return args.func(args)
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        # Known failure modes carry actionable messages; show them without a traceback.
        from ddppipe import checkpoint, config, download, environments, idx

        known = (
            config.ConfigError,
            download.DownloadError,
            idx.IdxError,
            checkpoint.CheckpointError,
            environments.LauncherEnvError,
            FileNotFoundError,
        )
        if isinstance(e, known):
            print(f"ddppipe {args.command}: error: {e}", file=sys.stderr)
            return 2
        raise
