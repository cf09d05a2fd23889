"""The run's files the summary reads: its config (as a :class:`~ddppipe.settings.run_spec.RunSpec`
where it is one), its metrics and its attempt history, from the state folder while it trains
and from ``train/`` once it completed. Only files: no torch, no SLURM.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ddppipe.core import jsonl
from ddppipe.runstate import prelaunch_failures
from ddppipe.runstate.state import StateDir
from ddppipe.settings import config, layout
from ddppipe.settings.run_spec import RunSpec

# libyaml's safe loader where PyYAML has it: 10x faster (a sweep's table reads 1,000 configs)
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@dataclass(frozen=True)
class About:
    """What the summary says of the run's config."""

    configured: bool  # whether the run's config was written yet
    kind: layout.RunKind
    trains: str  # the task (its file or module) or the script
    sha256: str | None  # of the task's or script's file
    accuracy_targets: tuple[float, ...]
    spec: RunSpec | None  # None: a config from before the spec (no ``resolved``), or foreign


@dataclass(frozen=True)
class RunFiles:
    """What a run left so far."""

    layout: layout.RunLayout
    about: About
    history: list[dict[str, Any]]  # metrics: one record per epoch (a script's job.log calls)
    attempts: list[dict[str, Any]]  # one record per job slot
    evaluation: dict[str, Any]  # a task's final evaluation (train/evaluation.json); {}: none yet
    # the job that failed before its launcher started, when no slot started since
    early_failure: prelaunch_failures.EarlyFailure | None = None

    @property
    def jobs(self) -> list[str]:
        """The SLURM job ids of the slots (a job once per slot it ran); not a packed trial's
        allocation (its job holds other trials too: sacct's figures of it are not the run's)."""
        return [a["job"] for a in self.attempts
                if a.get("job", "local") != "local" and not a.get("slot")]  # fmt: skip


def spec_of(cfg: Mapping[str, Any]) -> RunSpec | None:
    """The spec of a resolved config; None for a config from an older ddppipe (no
    ``resolved``) or a foreign one, which the summary describes without an allocation."""
    try:
        return RunSpec.from_config(cfg)
    except (KeyError, TypeError):  # a key missing (``resolved`` first of all) or misshapen
        return None


def about(cfg: Mapping[str, Any]) -> About:
    """What the summary says of the config ``cfg`` (``{}``: none written yet)."""
    spec = spec_of(cfg)
    if spec is None:
        return _unresolved(cfg)
    return About(
        configured=True,
        kind=spec.kind,
        trains=spec.script or spec.task,  # a script run names its script
        sha256=(spec.task_source or {}).get("sha256"),
        accuracy_targets=spec.scaling.accuracy_targets,
        spec=spec,
    )


def _unresolved(cfg: Mapping[str, Any]) -> About:
    """A config without a spec: what it names, the schema's defaults for what it lacks."""
    props = config.schema()["properties"]
    run_kind = layout.kind(cfg)
    source = cfg.get("task_source") or {}
    return About(
        configured=bool(cfg),
        kind=run_kind,
        trains=cfg["script"] if run_kind == "script" else cfg.get("task", props["task"]["default"]),
        sha256=source.get("sha256"),
        accuracy_targets=tuple(_section(cfg, "scaling", props)["accuracy_targets"]),
        spec=None,
    )


def _section(cfg: Mapping[str, Any], name: str, props: dict[str, Any]) -> dict[str, Any]:
    """The section ``name`` checked against the schema and filled with its defaults; the
    defaults alone where the section is missing or not valid."""
    try:
        return config.validate_against(copy.deepcopy(cfg.get(name) or {}), props[name], name)
    except config.ConfigError:
        return config.validate_against({}, props[name], name)


def _first(*paths: Path) -> Path | None:
    return next((p for p in paths if p.exists()), None)


def load(run_dir: Path) -> RunFiles:
    """The files of the run in ``run_dir`` (``results/<run>``)."""
    run = layout.RunLayout.of_root(run_dir)
    live = StateDir(run.state)  # while it trains; train/ once it completed
    cfg = yaml.load(run.config.read_text(), Loader=SAFE_LOADER) if run.config.exists() else {}
    metrics_path = _first(run.train.metrics, live.metrics)
    attempts_path = _first(run.train.attempts, live.attempts)
    evaluation = run.train.evaluation
    attempts = json.loads(attempts_path.read_text()) if attempts_path else []
    return RunFiles(
        layout=run,
        about=about(cfg),
        history=jsonl.read(metrics_path) if metrics_path else [],
        attempts=attempts,
        evaluation=json.loads(evaluation.read_text()) if evaluation.exists() else {},
        early_failure=prelaunch_failures.latest(
            prelaunch_failures.load(live), [float(a["start"]) for a in attempts]
        ),
    )
