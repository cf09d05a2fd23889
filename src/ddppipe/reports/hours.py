"""The arithmetic of a run's slots: what each held (memory, time limit, CPUs or GPUs), their
measured figures added up, and the GPU- or CPU-hours they held and trained.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ddppipe.core import system
from ddppipe.reports import goodput
from ddppipe.settings.run_spec import RunSpec
from ddppipe.slurm import request as slurm_request

PHASES = ("startup_s", "data_s", "train_s", "evaluate_s", "checkpoint_s")  # a slot's timed parts


@dataclass(frozen=True)
class Allocation:
    """What each slot of the run held; without a spec (an older or foreign config) no limits,
    no CPUs, and one fp32 process: nothing to compare with."""

    mem_mb: int | None = None  # a node's memory limit; None: no such limit (a local run)
    runtime_min: int | None = None  # the time limit; None: none
    cpus: int = 0  # every node's together
    gpus: int = 0  # one per process on GPUs
    processes: int = 1
    precision: str = "fp32"

    @classmethod
    def of(cls, spec: RunSpec | None, local: bool) -> Allocation:
        """The allocation of the run ``spec`` on a local machine or (not ``local``) SLURM."""
        if spec is None:
            return cls()
        held: dict[str, Any] = {
            "gpus": spec.world_size if spec.gpus else 0,  # one per process
            "processes": spec.world_size,
            "precision": spec.train.precision,
        }
        try:
            request = slurm_request.Request.from_spec(spec)
        except (
            slurm_request.SlurmRequestError
        ):  # no request SLURM would take: nothing to compare with
            return cls(**held)
        if local:
            return cls(cpus=request.node_threads(system.available_cpus()), **held)
        cpus = request.cpus_per_node * request.nodes
        return cls(mem_mb=request.mem_mb, runtime_min=request.runtime, cpus=cpus, **held)

    @property
    def unit(self) -> tuple[str, int]:
        """What the hours count and how many of them each slot held: GPUs, else CPUs."""
        return ("GPU", self.gpus) if self.gpus else ("CPU", self.cpus)


@dataclass(frozen=True)
class Slots:
    """The measured slots' figures (the attempts with an ``efficiency`` record) added up."""

    count: int
    wall_s: float  # a slot still training counts until now
    phases: dict[str, float] = field(default_factory=dict)  # seconds per PHASES key
    cpu_s: float = 0.0
    memory_peak_mb: float = 0.0  # the fullest node of any slot
    queue_s: float = 0.0

    @classmethod
    def of(cls, measured: list[dict[str, Any]]) -> Slots:
        figures = [a["efficiency"] for a in measured]
        return cls(
            count=len(measured),
            wall_s=sum((a.get("end") or time.time()) - a["start"] for a in measured),
            phases={k: sum(e.get(k, 0.0) for e in figures) for k in PHASES},
            cpu_s=sum(e.get("cpu_s", 0.0) for e in figures),
            memory_peak_mb=max((e.get("memory_peak_mb", 0.0) for e in figures), default=0.0),
            queue_s=sum(a.get("queue_s") or 0.0 for a in measured),
        )


def measured(attempts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The attempts whose ranks recorded their figures."""
    return [a for a in attempts if a.get("efficiency")]


def hours(units: int, seconds: float) -> float:
    """``units`` CPUs or GPUs held for ``seconds``, in CPU- or GPU-hours."""
    return units * seconds / 3600


@dataclass(frozen=True)
class Cost:
    """What a run's measured slots held and trained, in GPU- (else CPU-) hours, and how long
    they queued: the summary's allocation line in numbers (a sweep's table compares them)."""

    unit: str  # GPU | CPU
    units: int  # held by each slot
    held_h: float
    training_h: float
    queue_s: float
    goodput: float | None = None  # of the node time held, the share that trained kept steps

    @classmethod
    def of(cls, spec: RunSpec | None, attempts: list[dict[str, Any]]) -> Cost | None:
        """The cost of the slots in ``attempts`` (None before one recorded its figures)."""
        slots = measured(attempts)
        if not slots:
            return None
        held = Allocation.of(spec, slots[-1]["job"] == "local")
        total = Slots.of(slots)
        unit, units = held.unit
        run = goodput.account(attempts)
        return cls(unit, units, hours(units, total.wall_s), hours(units, total.phases["train_s"]),
                   total.queue_s, run.total.share if run else None)  # fmt: skip
