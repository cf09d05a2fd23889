"""The launching subcommands: resolve a config, launch a slot, check a SLURM job's nodes.

Imports are inside each command, so that one loads only what it needs.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ddppipe.core.errors import UserError

if TYPE_CHECKING:
    from ddppipe.runstate.state import StateDir


def resolve_config(
    config_path: Path | None, json_text: str | None, gpus: str | None, out: Path
) -> int:
    """``ddppipe resolve-config``: validate a config (a file, or JSON text), fill in its preset
    for the device (``gpus`` "yes"/"no", default this machine's answer), write it to ``out``."""
    import yaml

    from ddppipe.cli.commands.settings import json_config
    from ddppipe.launching import resolve
    from ddppipe.settings import config

    if json_text is not None:
        cfg = config.validate(json_config(json_text))
    else:
        with open(config_path) as f:
            cfg = config.validate(yaml.safe_load(f))
    # by hand: decided here (write_resolved), where the run is submitted; or as asked
    resolve.write_resolved(cfg, out, None if gpus is None else gpus == "yes")
    return 0


def launch(
    config_path: Path, data: Path | None, state: Path, checkpoint: Path | None,
    outputs: Path | None, metrics: Path, attempts: Path | None, log: Path | None,
) -> int:  # fmt: skip
    """``ddppipe launch``: train one slot; with ``log``, a copy of the state's train.log."""
    from ddppipe.launching import lifecycle
    from ddppipe.runstate.state import StateDir

    folder = StateDir(state)

    def slot() -> int:
        return _launch(config_path, data, folder, checkpoint, outputs, metrics, attempts)

    try:
        if log is None:
            return slot()
        with lifecycle.slot_log(folder, log):
            try:
                return slot()
            except (UserError, FileNotFoundError) as e:  # into the log too, not only Snakemake's
                print(f"ddppipe launch: error: {e}", file=sys.stderr)
                raise
    finally:
        lifecycle.mark_slot_end(folder)


def _launch(
    config_path: Path, data: Path | None, state: StateDir, checkpoint: Path | None,
    outputs: Path | None, metrics: Path, attempts: Path | None,
) -> int:  # fmt: skip
    from ddppipe.apptainer import running
    from ddppipe.launching import lifecycle
    from ddppipe.runstate import publish
    from ddppipe.settings import config, run_spec

    spec = run_spec.load(config_path)
    if spec.kind == "script":
        if outputs is None:
            raise config.ConfigError("ddppipe launch: a script run needs --outputs")
        # the script as `python SCRIPT ARGS` runs it, its failure recorded (runstate.failures)
        runner = ["-m", "ddppipe.training.script.run_script"]
        program = [*runner, spec.task_source["path"], *spec.script_args]
        return lifecycle.run(
            spec, running.python_command(spec), program, state, attempts,
            lambda: publish.script_results(state, outputs, metrics),
        )  # fmt: skip
    if data is None or checkpoint is None:
        raise config.ConfigError("ddppipe launch: a task run needs --data and --checkpoint")
    train_args = _train_args(config_path, data, state, checkpoint, metrics)
    return lifecycle.run(spec, running.python_command(spec, data),
                         ["-m", "ddppipe", "train", *train_args], state, attempts,
                         data=data)  # fmt: skip


def preflight(config_path: Path) -> int:
    """``ddppipe preflight``: check the SLURM job's nodes before training; print the report."""
    import yaml

    from ddppipe.apptainer import running
    from ddppipe.launching import launch, preflight
    from ddppipe.parallel import devices
    from ddppipe.settings import config, run_spec

    with open(config_path) as f:
        cfg = yaml.safe_load(f)
    recorded = (cfg.get("resolved") or {}).get("device")  # a run's config, or one by hand
    gpus = recorded == "gpu" if recorded else devices.trains_on_gpus(config.validate(cfg), False)
    spec = run_spec.resolve(cfg, gpus)
    python = running.python_command(spec)
    plan = launch.plan(spec, ["train"], python)
    if plan.job is None:
        raise config.ConfigError("ddppipe preflight checks a SLURM job's nodes: run it in one")
    print(preflight.run(spec, plan, python), end="")
    return 0


def preflight_node(host: str | None, nproc: int, use: str, precision: str) -> int:
    """``ddppipe preflight-node``: resolve the host, check the devices; exit 3 on a problem."""
    from ddppipe.parallel import node_check

    report, problems = node_check.check_node(host, nproc, use, precision)
    node_check.say(problems)
    if report:
        print(f"{node_check.PREFIX}{report}", flush=True)
    return node_check.EXIT_CODE if problems else 0


def _train_args(
    config: Path, data: Path, state: StateDir, checkpoint: Path, metrics: Path
) -> list[str]:
    """``ddppipe train``'s arguments for a task run's ranks."""
    return [
        f"--config={config}",
        f"--data={data}",
        f"--state={state.root}",
        f"--checkpoint={checkpoint}",
        f"--metrics={metrics}",
    ]
