"""A model-based sweep's rounds: Optuna's TPE sampler suggests each trial the moment a slot frees.

Round 0 holds the first ``sweep.max_parallel`` trials; every later round one trial. Round k's
job (the workflow's checkpoint ``sweep_round``) starts once round k - 1 is written and waits
for a free slot: ``k`` of the trials before it ended, whichever they are
(:mod:`ddppipe.sweeps.slots`), not the end of a round of trials nor one trial fixed in advance.
It then opens the sweep's Optuna study (the journal file
``results/sweeps/<sweep>/optuna.journal``: no database server, safe on shared filesystems),
tells it the final metric of each finished trial it does not know yet (the training's pruning
may have told it already that a trial completed or was pruned: a finished Optuna trial is never
told twice), and asks the sampler, which takes the trials still training for the worst (TPE's
constant liar) rather than suggesting their neighbourhood again; it writes ``rounds/<k>.json``
(with the trials it saw end and how long it waited for the slot).

Asking is idempotent: each Optuna trial records its ddppipe trial and round (user
attributes), so writing round ``k`` again (its checkpoint re-run) gives the same trials.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from ddppipe.core import atomic
from ddppipe.runstate import sweep_rounds
from ddppipe.settings import layout as run_layout
from ddppipe.settings import sweep as sweeps
from ddppipe.settings import trial_names
from ddppipe.settings.config import ConfigError
from ddppipe.sweeps import slots

log = logging.getLogger(__name__)
ROUND_ATTR = "ddppipe_round"  # the round that suggested an Optuna trial
DUPLICATE_ATTR = "ddppipe_duplicate_of"  # a draw whose trial exists already: not trained
ASKS_PER_TRIAL = 20  # draws before a small space is taken as exhausted


def open_study(sweep: sweeps.Sweep, journal: Path | None = None, sampler: Any = None) -> Any:
    """The sweep's Optuna study (created on first use) in its journal file."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    path = journal or sweep.layout.journal
    path.parent.mkdir(parents=True, exist_ok=True)
    storage = JournalStorage(JournalFileBackend(str(path)))
    return optuna.create_study(storage=storage, study_name=sweep.name, sampler=sampler,
                               direction=sweep.direction, load_if_exists=True)  # fmt: skip


def final_metric(sweep: sweeps.Sweep, evaluation: Path) -> float:
    """The metric of a trial's final evaluation (``eval/metrics.json``: ``test_<metric>``)."""
    found = json.loads(evaluation.read_text())
    key = f"test_{sweep.metric}"
    if not isinstance(found.get(key), int | float):
        names = sorted(k.removeprefix("test_") for k in found if k.startswith("test_"))
        raise ConfigError(
            f"sweep {sweep.name}: sweep.metric {sweep.metric!r} is not in {evaluation} "
            f"(no {key}); its metrics: {', '.join(names)}. Set sweep.metric to one of them"
        )
    return float(found[key])


def _by_trial(study: Any) -> dict[str, list[Any]]:
    """The study's Optuna trials of each ddppipe trial (by its name)."""
    out: dict[str, list[Any]] = {}
    for t in study.get_trials(deepcopy=False):
        name = t.user_attrs.get(sweeps.OPTUNA_TRIAL_ATTR)
        if name is not None:
            out.setdefault(trial_names.current_name(name), []).append(t)
    return out


def tell_finished(sweep: sweeps.Sweep, study: Any, finished: list[sweeps.Trial],
                  results: Path = run_layout.RESULTS) -> int:  # fmt: skip
    """Tell the study the final metric of each finished trial it has not been told of yet;
    the number told."""
    from optuna.trial import TrialState

    told, known = 0, _by_trial(study)
    for trial in finished:
        mine = known.get(trial.name, [])
        if any(t.state.is_finished() for t in mine):
            continue  # told already (here, or by the training's pruning)
        running = [t for t in mine if t.state == TrialState.RUNNING]
        if not running:
            continue  # not a trial this study suggested
        evaluation = evaluation_of(trial.run, results)
        if evaluation is None:
            continue  # still training: the sampler takes it as running
        study.tell(running[0].number, final_metric(sweep, evaluation))
        told += 1
    return told


def evaluation_of(run: str, results: Path) -> Path | None:
    """A finished trial's final evaluation: its training's (as soon as the training ended),
    or its evaluation rule's (a script's logged values); None while it trains."""
    layout = run_layout.RunLayout(run, results)
    for path in (layout.train.evaluation, layout.eval.metrics):
        if path.is_file():
            return path
    return None


def _asked(study: Any, k: int) -> list[Any]:
    """The Optuna trials round ``k`` suggested (not its duplicates), in order."""
    return [
        t
        for t in study.get_trials(deepcopy=False)
        if t.user_attrs.get(ROUND_ATTR) == k and DUPLICATE_ATTR not in t.user_attrs
    ]


def suggest(sweep: sweeps.Sweep, study: Any, k: int, size: int,
            taken: list[dict[str, Any]]) -> list[dict[str, Any]]:  # fmt: skip
    """Round ``k``'s ``size`` trials (name, values, Optuna number), each distinct from ``taken``
    (the trials of the rounds before it) and from one another; the ones it asked before first."""
    from optuna.trial import TrialState

    labels = trial_names.labels_of(sweep.keys)
    seen = {trial_names.trial_name(v, labels) for v in taken}
    out = []
    for t in _asked(study, k):
        values = sweeps.from_sampled(sweep, t.params)
        seen.add(trial_names.trial_name(values, labels))
        name = trial_names.current_name(t.user_attrs[sweeps.OPTUNA_TRIAL_ATTR])
        out.append({"name": name, "values": values, "number": t.number})
    dists = sweeps.distributions(sweep)
    for _ in range(size * ASKS_PER_TRIAL):
        if len(out) >= size:
            break
        asked = study.ask(dists)
        values = sweeps.from_sampled(sweep, asked.params)
        name = trial_names.trial_name(values, labels)
        asked.set_user_attr(ROUND_ATTR, k)
        if name in seen:  # the sampler drew a trial that exists: not trained twice
            asked.set_user_attr(DUPLICATE_ATTR, name)
            study.tell(asked.number, state=TrialState.FAIL)
            continue
        asked.set_user_attr(sweeps.OPTUNA_TRIAL_ATTR, name)
        seen.add(name)
        out.append({"name": name, "values": values, "number": asked.number})
    return out[:size]


def write_round(sweep: sweeps.Sweep, k: int, out: Path, results: Path = run_layout.RESULTS,
                journal: Path | None = None) -> dict[str, Any]:  # fmt: skip
    """Round ``k``: wait for a free slot, tell the study the trials of the rounds before it,
    ask for its trials, write its file (atomically); its document."""
    import optuna

    rounds = out.parent
    sizes = sweep_rounds.round_sizes(sweep, rounds)
    if not 0 <= k < len(sizes):
        raise ConfigError(
            f"sweep {sweep.name}: no round {k}; {sweep.trials} trials, {sizes[0]} at once, "
            f"make rounds 0-{len(sizes) - 1}"
        )
    if k > 0 and not sweep_rounds.round_file(sweep, k - 1, rounds).is_file():
        raise ConfigError(f"sweep {sweep.name}: round {k - 1} has not been suggested yet")
    freed = slots.wait(sweep, k, rounds, results)
    if k:
        log.info("round %d: %s", k, freed.words())
    finished = sweep_rounds.trials(sweep, upto=k, rounds=rounds)
    # A seed per round: the sampler's first (random) draws differ from one round to the next;
    # the trials still training count as the worst (constant liar), so it looks elsewhere.
    sampler = optuna.samplers.TPESampler(seed=sweep.seed + k, constant_liar=True)
    study = open_study(sweep, journal, sampler)
    tell_finished(sweep, study, finished, results)
    before = [dict(t.values) for t in finished]
    picked = suggest(sweep, study, k, sizes[k], before)
    doc = {"round": k, "trials": picked, "after_ended": freed.ended,
           "waited_s": round(freed.waited_s, 2)}  # fmt: skip
    atomic.write_text(out, json.dumps(doc, indent=1) + "\n")
    return doc
