"""How long a rank may go without progress, phase by phase: the hang watchdog's allowances
(:mod:`ddppipe.launching.watchdog` reads the ranks' heartbeats against them), the process
group's timeout, always above them, and how long a rank waits for its DataLoader's next batch
(:func:`loader_wait_s`), below them.

A phase that recurs in a slot (an epoch's start: its loader's first batch; an evaluation) is
allowed its fixed bound the first time only; after that, what the slot measured: 10 times its
longest occurrence so far, never less than a step's allowance nor more than the fixed bound.
A hang at an epoch's start is then named in about two minutes, not ten (and the rank names a
DataLoader worker that stopped delivering sooner still: :func:`loader_wait_s`).

Start-up's bound grows with the run's nodes (:mod:`ddppipe.parallel.startup_limits`); the
others do not.

A collective that waits longer than the process group's timeout is aborted by torch (NCCL's
watchdog: SIGABRT, nothing recorded), so the timeout must leave the hang watchdog time to see
the hang, dump every rank's stack and name it (:func:`collective_timeout_s`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ddppipe.parallel import startup_limits
from ddppipe.training.measuring import heartbeat

# auto: a step may take this many times the slowest step seen in the slot, and at least
# AUTO_FLOOR_S (a file system's or the network's hiccup is no hang); until the slot's steps
# after each phase's first are seen (compilation, cuDNN's search, data loader start-up),
# FIRST_STEPS_S.
AUTO_FACTOR, AUTO_FLOOR_S, FIRST_STEPS_S = 10.0, 120.0, 600.0
# The phases that legitimately take long, each never less than a step's allowance:
# start-up (imports, the rendezvous, the process group, the model: at one node, growing with
# the nodes, :func:`fixed_bound`), data (the task's datasets), evaluation, an epoch's start
# (its loader's first batch), checkpoints (also loading one, and the final outputs).
PHASE_ALLOWANCE_S = {
    "start-up": float(startup_limits.START_UP[0]),
    "data": 900.0,
    "evaluate": 600.0,
    "checkpoint": 600.0,
    heartbeat.EPOCH_START: FIRST_STEPS_S,
}
# The phases whose later occurrences follow the first (the same work again): an epoch's start
# and an evaluation. The slot's figure only tightens the fixed bound (the process group's
# timeout stays above every allowance). Start-up and data come once a slot; a checkpoint's
# save may be quick in the background at one epoch's end and written in full at the last.
RECURRING = (heartbeat.EPOCH_START, "evaluate")
# A rank waits for its loader's next batch at most AUTO_FACTOR times the longest wait it has
# seen, and at least LOADER_FLOOR_S; before it has seen one, half the first steps' allowance;
# under a number in hang_timeout_s, half of it. Half: the rank names its stalled worker before
# the watchdog would name the rank.
LOADER_FLOOR_S = 30.0
# Beyond an allowance, the watchdog's poll, its stack dump and the kill take this long at most.
NAMING_S = 300.0
# auto: the collectives' timeout, fixed when the process group starts, is this (a step's
# allowance reaches it at steps of 12 minutes; longer ones want a number in hang_timeout_s).
AUTO_COLLECTIVE_S = 7200.0


def step_allowance(setting: float | str, slowest_step_s: float | None) -> float:
    """Seconds a training step may take (``launch.hang_timeout_s``: a number, or ``auto``
    from ``slowest_step_s``, the slowest step seen in the slot, None before one)."""
    if setting != "auto":
        return float(setting)
    if slowest_step_s is None:
        return FIRST_STEPS_S
    return max(AUTO_FLOOR_S, AUTO_FACTOR * slowest_step_s)


@dataclass(frozen=True)
class Allowance:
    """Seconds a rank may go without progress, and which allowance it is, in words."""

    seconds: float
    why: str


def fixed_bound(phase: str, nodes: int = 1) -> float:
    """``phase``'s fixed bound in a run on ``nodes`` nodes (start-up's grows with them)."""
    if phase == "start-up":
        return float(startup_limits.start_up_s(nodes))
    return PHASE_ALLOWANCE_S.get(phase, FIRST_STEPS_S)


def allowance(setting: float | str, phase: str, slowest_step_s: float | None,
              longest_s: float | None = None, nodes: int = 1) -> Allowance:  # fmt: skip
    """How long a rank in ``phase`` may go without progress in a run on ``nodes`` nodes;
    ``longest_s``: the longest it went without progress in an earlier occurrence of ``phase``
    in the slot (None: none)."""
    step = step_allowance(setting, slowest_step_s)
    if setting != "auto":
        step_why = "launch.hang_timeout_s"
    elif slowest_step_s is None:
        step_why = "the bound of a slot's first steps"
    else:
        step_why = f"{AUTO_FACTOR:.0f} x the slowest step of the slot, {slowest_step_s:.2f} s"
    if phase == heartbeat.STEP:
        return Allowance(step, f"a step's: {step_why}")
    fixed = fixed_bound(phase, nodes)
    if phase in RECURRING and longest_s is not None and AUTO_FACTOR * longest_s < fixed:
        after = f"{phase}'s after its first in the slot"
        if AUTO_FACTOR * longest_s <= step:
            return Allowance(step, f"{after}: a step's, {step_why}")
        return Allowance(AUTO_FACTOR * longest_s, f"{after}: {AUTO_FACTOR:.0f} x its longest "
                                                  f"so far, {longest_s:.2f} s")  # fmt: skip
    if step > fixed:
        return Allowance(step, f"{phase}'s: a step's, {step_why}")
    first = " (its first in the slot)" if phase in RECURRING and longest_s is None else ""
    return Allowance(fixed, f"{phase}'s fixed bound{first}")


def loader_wait_s(setting: float | str, longest_wait_s: float | None) -> float:
    """Seconds a rank waits for its DataLoader's next batch before it names the worker that
    owes it (``longest_wait_s``: the longest wait for a batch the rank has seen; None before)."""
    if setting != "auto":
        return float(setting) / 2
    if longest_wait_s is None:
        return FIRST_STEPS_S / 2
    return max(LOADER_FLOOR_S, AUTO_FACTOR * longest_wait_s)


def collective_timeout_s(setting: float | str, nodes: int = 1) -> float:
    """The process group's timeout under ``launch.hang_timeout_s`` ``setting`` in a run on
    ``nodes`` nodes: the longest allowance of any phase, plus the time the watchdog takes to
    name a hang (a number), or :data:`AUTO_COLLECTIVE_S` (``auto``: the step's allowance
    follows the steps)."""
    longest = max(fixed_bound(phase, nodes) for phase in PHASE_ALLOWANCE_S)
    if setting == "auto":
        return max(AUTO_COLLECTIVE_S, longest + NAMING_S)
    return max(float(setting), longest) + NAMING_S
