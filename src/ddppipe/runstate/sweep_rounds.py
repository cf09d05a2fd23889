"""A model-based sweep's rounds as their files record them (``results/sweeps/<sweep>/rounds/``).

Each round's file lists the trials it suggested (written by :mod:`ddppipe.sweeps.rounds`);
read back here, they are the sweep's trials known now, how many rounds there are and which one
comes next. ``rounds``: the rounds' folder, the sweep's own without it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ddppipe.settings import sweep as sweeps


def round_file(sweep: sweeps.Sweep, k: int, rounds: Path | None = None) -> Path:
    """Round ``k``'s file: the trials it suggested (``{"round", "trials": [{"name",
    "values", "number"}]}``, ``number``: the Optuna trial's)."""
    return (rounds or sweep.layout.rounds) / f"{k}.json"


def whole_rounds(sweep: sweeps.Sweep, rounds: Path | None = None) -> bool:
    """Whether the sweep's rounds were suggested whole (``max_parallel`` trials a round, each
    once every trial before it finished), as before slot-wise suggestions."""
    path = round_file(sweep, 1, rounds)
    return path.is_file() and len(json.loads(path.read_text())["trials"]) > 1


def round_sizes(sweep: sweeps.Sweep, rounds: Path | None = None) -> list[int]:
    """A model-based sweep's rounds: the first ``max_parallel`` trials together, then one
    trial a round, suggested the moment a slot frees (:func:`ended_before`). A sweep suggested in
    whole rounds of ``max_parallel`` before (its round 1 holds more than one trial) keeps them."""
    if whole_rounds(sweep, rounds):
        full, rest = divmod(sweep.trials, sweep.max_parallel)
        return [sweep.max_parallel] * full + ([rest] if rest else [])
    first = min(sweep.max_parallel, sweep.trials)
    return [first] + [1] * (sweep.trials - first)


def ended_before(sweep: sweeps.Sweep, k: int, rounds: Path | None = None) -> int:
    """How many of the trials before round ``k`` must have ended before it is suggested: one
    a trial of the round, so each has a free slot (round ``k`` >= 1 takes the slot the ``k``-th
    trial to end freed, whichever it is; :mod:`ddppipe.sweeps.slots`). A sweep suggested in
    whole rounds: every trial before it (the workflow waits for their evaluations)."""
    if whole_rounds(sweep, rounds):
        return sum(round_sizes(sweep, rounds)[:k])
    return k


def unsuggested_round(sweep: sweeps.Sweep, rounds: Path | None = None) -> int | None:
    """A model-based sweep's first round not suggested yet; None once every round is."""
    sizes = round_sizes(sweep, rounds)
    return next((k for k in range(len(sizes)) if not round_file(sweep, k, rounds).is_file()), None)


def round_entries(
    sweep: sweeps.Sweep, rounds: Path | None = None, upto: int | None = None
) -> list[dict[str, Any]]:
    """The trials (``name``, ``values``, ``number``) a model-based sweep's rounds (those before
    round ``upto``; all without it) have suggested so far, in order; a round not suggested yet
    ends the list."""
    entries: list[dict[str, Any]] = []
    for k in range(len(round_sizes(sweep, rounds)) if upto is None else upto):
        path = round_file(sweep, k, rounds)
        if not path.is_file():
            break
        entries.extend(json.loads(path.read_text())["trials"])
    return entries


def trials(
    sweep: sweeps.Sweep, upto: int | None = None, rounds: Path | None = None
) -> list[sweeps.Trial]:
    """The sweep's trials known now (:func:`ddppipe.settings.sweep.trials`): a model-based
    method's those its rounds suggested (the rounds before ``upto``; all without it)."""
    suggested = round_entries(sweep, rounds, upto) if sweep.method == "tpe" else []
    return sweeps.trials(sweep, suggested)


def rounds_note(sweep: sweeps.Sweep) -> str:
    """What a model-based sweep's rounds are and how far they got, for the terminal (a dry
    run shows only the jobs of the rounds suggested so far)."""
    sizes = round_sizes(sweep)
    done = sum(1 for k in range(len(sizes)) if round_file(sweep, k).is_file())
    how = (
        f"in {len(sizes)} rounds of up to {sweep.max_parallel} (sweep.max_parallel), each "
        "suggested from the trials of the rounds before it"
        if whole_rounds(sweep)
        else f"{sizes[0]} at once (sweep.max_parallel), each next one suggested the moment a "
        "slot frees"
    )
    return (
        f"sweep {sweep.name}: {sweep.method}, {sweep.trials} trials {how}; {done} of "
        f"{len(sizes)} rounds suggested so far"
        + ("" if done == len(sizes) else ": the jobs of later rounds appear as they are suggested")
    )
