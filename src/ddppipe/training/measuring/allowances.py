"""How long a rank may go without progress, phase by phase: the hang watchdog's allowances
(:mod:`ddppipe.launching.watchdog` reads the ranks' heartbeats against them), and the process
group's timeout, always above them.

A collective that waits longer than the process group's timeout is aborted by torch (NCCL's
watchdog: SIGABRT, nothing recorded), so the timeout must leave the hang watchdog time to see
the hang, dump every rank's stack and name it (:func:`collective_timeout_s`).
"""

from __future__ import annotations

from ddppipe.training.measuring import heartbeat

# auto: a step may take this many times the slowest step seen in the slot, and at least
# AUTO_FLOOR_S (a file system's or the network's hiccup is no hang); until the slot's steps
# after each phase's first are seen (compilation, cuDNN's search, data loader start-up),
# FIRST_STEPS_S.
AUTO_FACTOR, AUTO_FLOOR_S, FIRST_STEPS_S = 10.0, 120.0, 600.0
# The phases that legitimately take long, each never less than a step's allowance:
# start-up (imports, the rendezvous, the process group, the model), data (the task's
# datasets), evaluation, checkpoints (also loading one, and the final outputs).
PHASE_ALLOWANCE_S = {"start-up": 600.0, "data": 900.0, "evaluate": 600.0, "checkpoint": 600.0}
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


def allowance(setting: float | str, phase: str, slowest_step_s: float | None) -> float:
    """Seconds a rank in ``phase`` may go without progress."""
    step = step_allowance(setting, slowest_step_s)
    if phase == heartbeat.STEP:
        return step
    return max(step, PHASE_ALLOWANCE_S.get(phase, FIRST_STEPS_S))


def collective_timeout_s(setting: float | str) -> float:
    """The process group's timeout under ``launch.hang_timeout_s`` ``setting``: the longest
    allowance of any phase, plus the time the watchdog takes to name a hang (a number), or
    :data:`AUTO_COLLECTIVE_S` (``auto``: the step's allowance follows the steps)."""
    longest = max(PHASE_ALLOWANCE_S.values())
    if setting == "auto":
        return max(AUTO_COLLECTIVE_S, longest + NAMING_S)
    return max(float(setting), longest) + NAMING_S
