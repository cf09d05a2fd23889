"""The scaling study's grid: one training run per (nodes, processes per node, CPUs per process).

Each grid point is a run named ``scaling-n<nodes>-p<procs per node>-c<cpus per task>``; its
config is the base config with the point's launch settings (``launch.nnodes``,
``launch.nproc_per_node``, ``launch.cpus_per_proc``) and the study's epoch count.
The global batch stays the base config's, so every point trains the same recipe and only the
way the work is spread changes.
"""

from __future__ import annotations

import copy
import itertools
import re
from dataclasses import dataclass
from typing import Any

from ddppipe.spec.config import ConfigError

_RUN = re.compile(r"^scaling-n(\d+)-p(\d+)-c(\d+)$")


@dataclass(frozen=True, order=True)
class Point:
    """One grid point of the study."""

    nodes: int
    procs_per_node: int
    cpus_per_proc: int

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    @property
    def run(self) -> str:
        return f"scaling-n{self.nodes}-p{self.procs_per_node}-c{self.cpus_per_proc}"

    @classmethod
    def from_run(cls, run: str) -> Point | None:
        """The point a run name stands for, or None when it is not a scaling run name."""
        match = _RUN.match(run)
        return cls(*(int(g) for g in match.groups())) if match else None

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> Point:
        """The point a (resolved) run config describes."""
        launch = cfg["launch"]
        return cls(launch["nnodes"], launch["nproc_per_node"], launch["cpus_per_proc"] or 0)


def grid(cfg: dict[str, Any]) -> list[Point]:
    """Every point of the config's ``scaling`` section, sorted by nodes, processes, CPUs."""
    study = cfg["scaling"]
    axes = (study["nodes"], study["procs_per_node"], study["cpus_per_proc"])
    return sorted({Point(*values) for values in itertools.product(*axes)})


def run_names(cfg: dict[str, Any]) -> list[str]:
    return [point.run for point in grid(cfg)]


def apply(cfg: dict[str, Any], point: Point) -> dict[str, Any]:
    """A copy of ``cfg`` (without its ``scaling`` section) set up to train at ``point``."""
    out = copy.deepcopy(cfg)
    study = out.pop("scaling", None) or {}
    out["run"] = point.run
    out["launch"]["nnodes"] = point.nodes
    out["launch"]["nproc_per_node"] = point.procs_per_node
    out["launch"]["cpus_per_proc"] = point.cpus_per_proc  # GPUs (launch.device) follow processes
    if study.get("epochs") is not None:
        out["train"]["epochs"] = study["epochs"]
    return out


def config_for_run(cfg: dict[str, Any], run: str) -> dict[str, Any]:
    """The config of run ``run``: the base run's own, or a scaling grid point's.

    Raise ConfigError for any other name, so that a typo cannot train a mislabeled run.
    """
    if run == cfg["run"]:
        out = copy.deepcopy(cfg)
        out.pop("scaling", None)
        return out
    point = Point.from_run(run)
    points = grid(cfg)
    if point is None or point not in points:
        known = ", ".join([cfg["run"], *(p.run for p in points)])
        raise ConfigError(f"unknown run {run!r}: this config defines the runs {known}")
    return apply(cfg, point)
