"""A slot's start-up in parts: from the slot's start to its first step, derived from the clock
readings (marks) its processes left on the way (:mod:`ddppipe.core.process_times`).

The slot starts when its SLURM job started (a job of its own, the slot of the job's start),
else when its launcher (``ddppipe launch``) started. Each mark is a Unix time at which a part
ended and the next began; a process kind prefixes its own: the launcher's (``launcher_``),
a node's ``ddppipe agent``'s (``agent_``, torchrun's), the ranks' (``rank_``, the latest of
all ranks: the slowest rank holds the others at the next collective). The parts, in order:

- ``job to launcher``: the job's start to the launcher's process (the job's script, its
  Snakemake, the rule's shell);
- ``launcher``: the launcher's own work (its imports, the config, SLURM's records);
- ``launch``: from the launcher starting the ranks (srun's step, a local fork) to the first
  process of a node;
- ``container``: the container's start (Apptainer's starter to the Python it runs);
- ``interpreter``: a process's start to ddppipe's command in it (Python's own start);
- ``imports``: ddppipe's command to its modules imported (torch), the agent's and the rank's;
- ``rendezvous``: the agents' rendezvous and their start of the ranks;
- ``process group``: the ranks' ``init_process_group``, after their node's own checks where
  they make them (a SLURM job of its own: :func:`ddppipe.parallel.node_check.before_joining`;
  the agent's, before its imports, are in its ``imports``);
- ``checks``: the checks of the world once the ranks joined it (a SLURM job of its own:
  :mod:`ddppipe.training.measuring.world_checks`);
- ``data``: the data folder checked or staged, the datasets loaded, their workers started;
- ``model``: the model built and wrapped, its optimizer, the trackers;
- ``checkpoint load``: the resume from the newest checkpoint (or finding none);
- ``first step``: to the first step done (its batch, forward, backward, all-reduce).

A mark that is missing merges its part into the next one; a mark earlier than the one before
(clocks of two nodes) counts 0 s. The parts add up to the time from the slot's start to its
first step done; up to the first step's start they are the slot's start-up (``startup_s``,
the goodput's start-up loss: the first step itself counts as training).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

LAUNCH, CONTAINER, FIRST_STEP, CHECKS = "launch", "container", "first step", "checks"
LAUNCHER_PROCESS = "launcher_process"  # present when the slot started with its job
RANKS_LAUNCHED = "launcher_ranks_launched"
CONTAINER_MARKS = ("agent_container", "rank_container")

# (mark, the part that ends at it), in the order they happen
MARKS: tuple[tuple[str, str], ...] = (
    (LAUNCHER_PROCESS, "job to launcher"),
    (RANKS_LAUNCHED, "launcher"),
    ("agent_container", LAUNCH),
    ("agent_process", CONTAINER),
    ("agent_entered", "interpreter"),
    ("agent_imported", "imports"),
    ("rank_container", LAUNCH),
    ("rank_process", "rendezvous"),
    ("rank_entered", "interpreter"),
    ("rank_imported", "imports"),
    ("rank_process_group", "process group"),
    ("rank_checks", CHECKS),
    ("rank_data", "data"),
    ("rank_model", "model"),
    ("rank_resumed", "checkpoint load"),
    ("rank_first_step", FIRST_STEP),
)

# the parts in the order they happen (a record's JSON sorts its keys: :func:`of_attempt`)
PARTS = (
    "job to launcher",
    "launcher",
    LAUNCH,
    CONTAINER,
    "interpreter",
    "imports",
    "rendezvous",
    "process group",
    CHECKS,
    "data",
    "model",
    "checkpoint load",
    FIRST_STEP,
)


def slot_start(now: float, launcher: float | None, job: float | None) -> float:
    """When a slot started: its job's start ``job`` (None: not a job of its own, or not the
    job's first slot), else its launcher's process start ``launcher``, else ``now``."""
    if job is not None:
        return min(job, launcher if launcher is not None else now)
    return launcher if launcher is not None else now


def latest(per_process: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Each mark's latest reading among processes (the ranks of a slot)."""
    found: dict[str, float] = {}
    for marks in per_process:
        for key, value in marks.items():
            found[key] = max(found.get(key, value), value)
    return found


def _name(key: str, default: str, previous: str | None) -> str:
    """The part that ends at mark ``key`` after the mark ``previous``: the launch when it
    follows the launcher's start of the ranks, the container when it follows a container's
    start, else its own."""
    if previous == RANKS_LAUNCHED:
        return LAUNCH
    if previous in CONTAINER_MARKS:
        return CONTAINER
    return default


def parts(start: float, marks: Mapping[str, float]) -> dict[str, float]:
    """The start-up's parts (name: seconds, in order) from the slot's ``start`` and ``marks``."""
    present = dict(marks)
    if any(key.startswith("agent_") for key in present):  # the ranks run in the agent's container
        present.pop("rank_container", None)
    found: dict[str, float] = {}
    cursor, previous = start, None
    for key, default in MARKS:
        if key not in present:
            continue
        at = max(cursor, float(present[key]))
        name = _name(key, default, previous)
        found[name] = found.get(name, 0.0) + at - cursor
        cursor, previous = at, key
    return found


def before_first_step(found: Mapping[str, float]) -> float:
    """The slot's start-up: its parts up to the first step's start."""
    return sum(v for k, v in found.items() if k != FIRST_STEP)


def from_job(found: Mapping[str, float]) -> bool:
    """Whether the parts count from the slot's job's start (else from its launcher's)."""
    return next(iter(found), None) == "job to launcher"


def of_attempt(attempt: Mapping[str, Any]) -> dict[str, float] | None:
    """The parts an attempt record holds (``startup``), in order; None without them."""
    found = attempt.get("startup")
    return {name: found[name] for name in PARTS if name in found} if found else None
