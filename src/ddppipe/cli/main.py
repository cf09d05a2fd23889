"""The ``ddppipe`` command: one subcommand per pipeline step, called by the Snakemake rules."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import NoReturn

from ddppipe import __version__
from ddppipe.core.errors import UserError


def _setup_logging() -> None:
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def _train_paths(args: argparse.Namespace):
    from ddppipe.training.train import Paths

    return Paths(args.data, args.state, args.checkpoint, args.metrics)


def _json_config(text: str) -> dict:
    """The ``--json`` argument (the rules pass the config as JSON text); raise ConfigError."""
    from ddppipe.spec import config

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise config.ConfigError(f"--json: not JSON text ({e})") from e
    if not isinstance(value, dict):
        raise config.ConfigError(f"--json: expected a JSON object, got {type(value).__name__}")
    return value


def cmd_resolve_config(args: argparse.Namespace) -> int:
    import yaml

    from ddppipe.launching import resolve
    from ddppipe.parallel import devices
    from ddppipe.spec import config

    if args.json is not None:
        cfg = config.validate(_json_config(args.json))
    else:
        with open(args.config) as f:
            cfg = config.validate(yaml.safe_load(f))
    gpus = devices.trains_on_gpus(cfg, slurm=False) if args.gpus is None else args.gpus == "yes"
    resolve.write_resolved(cfg, args.out, gpus)
    return 0


def cmd_data_settings(args: argparse.Namespace) -> int:
    from ddppipe.spec import config

    config.write(_json_config(args.json), args.out)  # the Snakefile validated the config
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from ddppipe import tasks
    from ddppipe.data import manifest
    from ddppipe.spec import config

    settings = config.load_data_settings(args.settings)
    task = tasks.load(settings["task"])
    task_args = tasks.validate_args(task, settings["task_args"])
    args.dest.mkdir(parents=True, exist_ok=True)
    task.call("prepare", args.dest, task_args)
    found = manifest.write(args.dest, task.source.as_dict(), task_args)
    print(f"{len(found['files'])} file(s) in {args.dest}, digest {found['digest']}",
          file=sys.stderr)  # fmt: skip
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from ddppipe.runstate import preemption

    # First, before torch loads: a stop signal from now on is noted, never lost or fatal.
    guard = preemption.Guard()
    try:
        from ddppipe.spec import config
        from ddppipe.training import train

        train.train(config.load_resolved(args.config), _train_paths(args), guard)
    except preemption.Preempted as e:
        logging.getLogger("ddppipe").warning("%s", e)
        code = 0 if os.environ.get(preemption.UNDER_AGENT_ENV) else preemption.EXIT_CODE
    else:
        code = 0
    finally:
        guard.restore()
    _exit_now(code)


def _exit_now(code: int) -> NoReturn:
    """Exit with ``code`` now, without the interpreter's finalization.

    A worker gets here with its outputs written and the process group left. Finalization
    would only free torch's objects, and a gloo rank once aborted there (SIGABRT, "terminate
    called without an active exception", CI 2026-11-23) after a complete training: its
    agent then failed the slot and killed the other rank.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def cmd_launch(args: argparse.Namespace) -> int:
    from ddppipe.launching import lifecycle

    try:
        if args.log is None:
            return _launch(args)
        with lifecycle.slot_log(args.state, args.log):
            try:
                return _launch(args)
            except (UserError, FileNotFoundError) as e:  # into the log too, not only Snakemake's
                print(f"ddppipe launch: error: {e}", file=sys.stderr)
                raise
    finally:
        lifecycle.mark_slot_end(args.state)


def _launch(args: argparse.Namespace) -> int:
    from ddppipe.launching import launch, lifecycle
    from ddppipe.runstate import publish
    from ddppipe.spec import config

    cfg = config.load_resolved(args.config)
    if cfg["script"]:
        if args.outputs is None:
            raise config.ConfigError("ddppipe launch: a script run needs --outputs")
        program = [cfg["task_source"]["path"], *cfg["script_args"]]
        return lifecycle.run(
            cfg, program, args.state, args.attempts,
            lambda: publish.script_results(args.state, args.outputs, args.metrics),
        )  # fmt: skip
    if args.data is None or args.checkpoint is None:
        raise config.ConfigError("ddppipe launch: a task run needs --data and --checkpoint")
    train_args = launch.train_args(
        args.config, args.data, args.state, args.checkpoint, args.metrics
    )
    return lifecycle.run(cfg, ["-m", "ddppipe", "train", *train_args], args.state, args.attempts)


def cmd_agent(args: argparse.Namespace) -> int:
    from ddppipe.launching import launch

    return launch.run_agent(args.torchrun_args)


def cmd_preflight(args: argparse.Namespace) -> int:
    from ddppipe.launching import launch, preflight
    from ddppipe.spec import config

    cfg = config.load(args.config)
    plan = launch.plan(cfg, ["train"])
    if plan.job is None:
        raise config.ConfigError("ddppipe preflight checks a SLURM job's nodes: run it in one")
    print(preflight.run(cfg, plan), end="")
    return 0


def cmd_attempts(args: argparse.Namespace) -> int:
    from ddppipe.core import atomic
    from ddppipe.runstate import attempts

    history = attempts.read(args.history)
    if args.html:
        atomic.write_text(args.html, attempts.html_table(history, args.run))
    else:
        print(attempts.table(history))
    return 0


def cmd_preflight_node(args: argparse.Namespace) -> int:
    from ddppipe.launching import preflight

    report, problems = preflight.check_node(args.host, args.nproc, args.use, args.precision)
    for problem in problems:
        print(f"preflight: {problem}", file=sys.stderr)
    if report:
        print(f"preflight: {report}", flush=True)
    return 3 if problems else 0


def cmd_preflight_allreduce(args: argparse.Namespace) -> int:
    from ddppipe.launching import preflight

    print(f"preflight: {preflight.allreduce(args.use, args.precision, args.peak_out)}",
          flush=True)  # fmt: skip
    _exit_now(0)  # a gloo rank like the training's (cmd_train)


def cmd_evaluate(args: argparse.Namespace) -> int:
    from ddppipe.core import atomic
    from ddppipe.reports import plots
    from ddppipe.spec import config
    from ddppipe.training import evaluate

    cfg = config.load_resolved(args.config)
    batch_size = args.batch_size or cfg["train"]["eval_batch_size"]
    result = evaluate.evaluate_checkpoint(args.checkpoint, cfg, args.data, batch_size)
    atomic.write_json(args.metrics, result)
    plots.evaluation(result, args.plot)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from ddppipe.core import atomic
    from ddppipe.runstate import publish
    from ddppipe.spec import config
    from ddppipe.training import provenance

    cfg = config.load_resolved(args.config)
    image = json.loads(Path(args.image_info).read_text()) if args.image_info else None
    history = json.loads(args.attempts.read_text()) if args.attempts else None
    if cfg["script"]:
        publish.copy_tree(args.result, args.out)
        record = provenance.script_record(cfg, args.out, image, history)
    else:
        if args.record is None:
            raise config.ConfigError("ddppipe export: a task run needs --record")
        publish.copy_file(args.result, args.out)
        final = json.loads(args.record.read_text())
        record = provenance.record(final, args.data, image, history)
    atomic.write_json(args.provenance, record)
    return 0


def cmd_plot_evaluation(args: argparse.Namespace) -> int:
    from ddppipe.core import atomic
    from ddppipe.reports import plots

    result = json.loads(args.evaluation.read_text())
    atomic.write_json(args.metrics, result)
    plots.evaluation(result, args.plot)
    return 0


def cmd_evaluate_logged(args: argparse.Namespace) -> int:
    from ddppipe.core import atomic, jsonl
    from ddppipe.reports import plots

    history = jsonl.read(args.metrics)
    result: dict[str, object] = {"points": len(history)}
    for record in history:  # the last value of every key the script logged
        result.update({k: v for k, v in record.items() if k != "time"})
    atomic.write_json(args.out, result)
    plots.evaluation({k: v for k, v in result.items() if k not in ("step", "points")},
                     args.plot, "last logged values")  # fmt: skip
    return 0


def cmd_build_image(args: argparse.Namespace) -> int:
    from ddppipe.apptainer import container
    from ddppipe.core import atomic

    container.build(args.recipe, args.image, args.log, args.context)
    atomic.write_json(args.info, container.image_info(args.image, args.recipe))
    return 0


def cmd_build_task_image(args: argparse.Namespace) -> int:
    from ddppipe.apptainer import container
    from ddppipe.core import atomic

    info = container.build_task_image(args.base, args.requirements, args.image, args.log)
    atomic.write_json(args.info, info)
    return 0


def cmd_image_info(args: argparse.Namespace) -> int:
    from ddppipe.apptainer import container
    from ddppipe.core import atomic

    atomic.write_json(args.out, container.image_info(args.image, args.recipe))
    return 0


def cmd_plot_training(args: argparse.Namespace) -> int:
    from ddppipe.core import jsonl
    from ddppipe.reports import plots

    history = jsonl.read(args.metrics)
    plots.training_curves(history, args.out)
    return 0


def cmd_plot_scaling(args: argparse.Namespace) -> int:
    from ddppipe.reports import scaling_plots, scaling_results

    results = scaling_results.load(args.metrics, args.configs)
    scaling_plots.learning_curves(results, args.curves)
    scaling_plots.throughput(results, args.throughput)
    rows = scaling_results.table(results, args.targets)
    scaling_results.write_csv(rows, args.table_csv)
    scaling_results.write_html(rows, args.table_html)
    return 0


def cmd_summary(args: argparse.Namespace) -> int:
    from ddppipe.reports import summary

    run_dir = args.results / args.run
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir}: no such run (its results folder is missing)")
    if args.html:
        from ddppipe.reports import summary_html

        summary_html.write(summary.build(run_dir), args.html)
    else:
        print(summary.text(run_dir))
    return 0


def cmd_selfcheck(args: argparse.Namespace) -> int:
    from ddppipe.training import selfcheck

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

    p = sub.add_parser(
        "resolve-config", help="validate a config, fill in its preset for this machine's device"
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", type=Path, help="a config file")
    source.add_argument("--json", help="the config as JSON text (the write_config rule)")
    p.add_argument("--gpus", choices=["yes", "no"], help="whether the run trains on GPUs "
                   "(default: this machine's answer)")  # fmt: skip
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(func=cmd_resolve_config)

    p = sub.add_parser("data-settings", help="write what a task's data depends on (data rule)")
    p.add_argument("--json", required=True, help="task and task_args as JSON text")
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(func=cmd_data_settings)

    p = sub.add_parser("prepare", help="run the task's prepare() and write the data manifest")
    p.add_argument(
        "--settings", type=Path, required=True, help="YAML with task: and task_args: (data rule)"
    )
    p.add_argument("--dest", type=Path, required=True, help="the task's data folder")
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser("train", help="one training process (started by torchrun/srun/mpirun)")
    _add_train_args(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser(
        "launch", help="train one slot: torchrun locally, or an srun step in a SLURM job"
    )
    p.add_argument("--config", type=Path, required=True, help="resolved config YAML")
    p.add_argument("--data", type=Path, help="the task's prepared data folder")
    p.add_argument("--state", type=Path, required=True, help="run state folder")
    p.add_argument("--checkpoint", type=Path, help="(task) final checkpoint to write")
    p.add_argument("--outputs", type=Path, help="(script) folder to publish its outputs to")
    p.add_argument("--metrics", type=Path, required=True, help="metrics (JSON lines) to write")
    p.add_argument("--attempts", type=Path, help="attempt history to write once complete")
    p.add_argument(
        "--log", type=Path, help="the rule's log: a copy of the state's train.log (every slot)"
    )
    p.set_defaults(func=cmd_launch)

    p = sub.add_parser("agent", help="torchrun on this node, safe from SIGUSR1 (srun starts it)")
    p.add_argument("torchrun_args", nargs=argparse.REMAINDER, help="torchrun arguments")
    p.set_defaults(func=cmd_agent)

    p = sub.add_parser("preflight", help="check the SLURM job's nodes before training")
    p.add_argument("--config", type=Path, required=True)
    p.set_defaults(func=cmd_preflight)

    p = sub.add_parser("attempts", help="print (or write as HTML) a run's attempt history")
    p.add_argument(
        "--history", type=Path, required=True,
        help="attempts.json (results/<run>/state/ while it trains, results/<run>/train/ after)",
    )  # fmt: skip
    p.add_argument("--run", default="run", help="run name for the HTML page's title")
    p.add_argument("--html", type=Path, help="HTML page to write instead of printing")
    p.set_defaults(func=cmd_attempts)

    p = sub.add_parser("preflight-node", help="(one per node) resolve the host, check devices")
    p.add_argument("--host", help="rendezvous host (default: the step's first node)")
    p.add_argument("--nproc", type=int, default=1, help="training processes on this node")
    p.add_argument("--use", choices=["gpu", "cpu", "auto"], default="auto", help="device")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.set_defaults(func=cmd_preflight_node)

    p = sub.add_parser(
        "preflight-allreduce",
        help="(one per rank, under torchrun) all-reduce, bandwidth and GEMM peak",
    )
    p.add_argument("--use", choices=["gpu", "cpu", "auto"], default="auto", help="device")
    p.add_argument("--precision", choices=["bf16", "fp32"], default="fp32",
                   help="the training's precision, for the GEMM peak")  # fmt: skip
    p.add_argument("--peak-out", type=Path, help="(rank 0) write the nodes' peaks here (JSON)")
    p.set_defaults(func=cmd_preflight_allreduce)

    p = sub.add_parser("evaluate", help="evaluate a checkpoint on the test set")
    p.add_argument("--checkpoint", type=Path, required=True)
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--metrics", type=Path, required=True, help="metrics JSON to write")
    p.add_argument(
        "--plot", type=Path, required=True, help="PNG to write: confusion matrix, else metrics"
    )
    p.add_argument("--config", type=Path, required=True, help="the run's resolved config")
    p.add_argument("--batch-size", type=int, help="default: train.eval_batch_size")
    p.set_defaults(func=cmd_evaluate)

    p = sub.add_parser("export", help="write the result and its provenance record")
    p.add_argument(
        "--result", type=Path, required=True, help="final weights (model.pt), or a script's outputs"
    )
    p.add_argument("--record", type=Path, help="the final checkpoint's record (final.json)")
    p.add_argument("--config", type=Path, required=True, help="the run's resolved config")
    p.add_argument("--data", type=Path, help="the task's prepared data folder")
    p.add_argument("--out", type=Path, required=True, help="weights (task) or folder (script)")
    p.add_argument("--provenance", type=Path, required=True)
    p.add_argument("--image-info", type=Path, help="JSON describing the container image used")
    p.add_argument("--attempts", type=Path, help="the run's attempt history (attempts.json)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser(
        "plot-evaluation", help="the training's final evaluation: metrics JSON and its figure"
    )
    p.add_argument("--evaluation", type=Path, required=True, help="train/evaluation.json")
    p.add_argument("--metrics", type=Path, required=True, help="metrics JSON to write")
    p.add_argument("--plot", type=Path, required=True, help="PNG to write")
    p.set_defaults(func=cmd_plot_evaluation)

    p = sub.add_parser("evaluate-logged", help="a script run's last logged values and plot")
    p.add_argument("--metrics", type=Path, required=True, help="metrics.jsonl of job.log")
    p.add_argument("--out", type=Path, required=True, help="metrics JSON to write")
    p.add_argument("--plot", type=Path, required=True, help="PNG to write")
    p.set_defaults(func=cmd_evaluate_logged)

    p = sub.add_parser("build-image", help="build the Apptainer image (atomically) and its info")
    p.add_argument("--recipe", type=Path, required=True, help="Apptainer definition file")
    p.add_argument("--image", type=Path, required=True, help=".sif to write")
    p.add_argument("--info", type=Path, required=True, help="image-info JSON (sha256, labels)")
    p.add_argument("--log", type=Path, required=True, help="apptainer build output")
    p.add_argument(
        "--context",
        type=Path,
        default=Path.cwd(),
        help="folder the recipe's %%files paths are relative to (repository root)",
    )
    p.set_defaults(func=cmd_build_image)

    p = sub.add_parser(
        "build-task-image", help="build the base image plus pinned pip packages, and its info"
    )
    p.add_argument("--base", type=Path, required=True, help="the ddppipe image to start from")
    p.add_argument("--image", type=Path, required=True, help=".sif to write (recipe: .def)")
    p.add_argument("--info", type=Path, required=True, help="image-info JSON (sha256, labels)")
    p.add_argument("--log", type=Path, required=True, help="apptainer build output")
    p.add_argument("requirements", nargs="+", help="pinned pip requirements (name==version)")
    p.set_defaults(func=cmd_build_task_image)

    p = sub.add_parser("image-info", help="write the info JSON (sha256, labels) of an image")
    p.add_argument("--image", type=Path, required=True)
    p.add_argument("--recipe", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(func=cmd_image_info)

    p = sub.add_parser("plot-training", help="plot per-epoch loss and accuracy")
    p.add_argument("--metrics", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(func=cmd_plot_training)

    p = sub.add_parser(
        "plot-scaling", help="figures and time-to-accuracy table of the scaling study"
    )
    p.add_argument(
        "--metrics", type=Path, nargs="+", required=True, help="metrics.jsonl of each grid point"
    )
    p.add_argument(
        "--configs",
        type=Path,
        nargs="+",
        required=True,
        help="resolved config.yaml of each grid point, in the same order",
    )
    p.add_argument(
        "--targets",
        type=float,
        nargs="+",
        default=[0.98, 0.99],
        help="test accuracies (fractions) to tabulate the time to",
    )
    p.add_argument("--curves", type=Path, required=True, help="learning-curves PNG to write")
    p.add_argument(
        "--throughput", type=Path, required=True, help="throughput and efficiency PNG to write"
    )
    p.add_argument("--table-csv", type=Path, required=True)
    p.add_argument("--table-html", type=Path, required=True)
    p.set_defaults(func=cmd_plot_scaling)

    p = sub.add_parser("summary", help="a run's summary: accuracy, targets, speed, attempts")
    p.add_argument("run", help="run name (results/<run>)")
    p.add_argument("--results", type=Path, default=Path("results"), help="results folder")
    p.add_argument("--html", type=Path, help="write it as an HTML fragment here (the report's)")
    p.set_defaults(func=cmd_summary)

    p = sub.add_parser("selfcheck", help="print versions and run a one-process DDP smoke test")
    p.set_defaults(func=cmd_selfcheck)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["agent"]:  # torchrun's own options follow; argparse would take them
        import signal

        from ddppipe.runstate import preemption

        # First, before torch loads (seconds on a busy node): the time-limit warning may come
        # while the agent starts, and would kill it (launch.run_agent says why it is ignored).
        signal.signal(preemption.stop_signal(), signal.SIG_IGN)
        from ddppipe.launching import launch

        return launch.run_agent(argv[1:])
    args = parser().parse_args(argv)
    _setup_logging()
    try:
        return args.func(args)
    except (UserError, FileNotFoundError) as e:
        # Known failure modes carry actionable messages; show them without a traceback.
        print(f"ddppipe {args.command}: error: {e}", file=sys.stderr)
        return 2
