"""The sweep subcommands: its trials (``sweep-trials``), its table and best trial
(``sweep-table``) and its figures (``plot-sweep``). None imports torch."""

from __future__ import annotations

import json
from pathlib import Path

from ddppipe.cli.commands.settings import json_config
from ddppipe.core import atomic
from ddppipe.settings import sweep
from ddppipe.settings.config import ConfigError, validate


def sweep_trials(config_json: str, out: Path) -> int:
    """``ddppipe sweep-trials``: the sweep's definition and its trials known now, as JSON (what
    the table lists), derived from the config as the workflow derived them."""
    from ddppipe.sweeps import trials

    found = sweep.from_config(validate(json_config(config_json)))
    if found is None:
        raise ConfigError("sweep-trials: the config has no sweep (sweep.name is null)")
    atomic.write_text(out, json.dumps(trials.document(found), indent=1) + "\n")
    return 0


def sweep_table(sweep_path: Path, csv: Path, best: Path) -> int:
    """``ddppipe sweep-table``: one row per trial (``--csv``), the best trial (``--best``) and
    the trials in TensorBoard's HParams view; prints the top trials."""
    from ddppipe.sweeps import results, table, trials

    found = trials.load(sweep_path)
    results.save(found, csv, best)
    print(table.text(found))
    return 0


def plot_sweep(sweep_path: Path, out_dir: Path) -> int:
    """``ddppipe plot-sweep``: the metric against each parameter, every trial's learning curve,
    a parallel-coordinates view, and the report's first screen (``overview.html``)."""
    from ddppipe.sweeps import figures, trials

    figures.write(trials.load(sweep_path), out_dir)
    return 0


def sweep_round(config_json: str, round: int, out: Path) -> int:
    """``ddppipe sweep-round``: a model-based sweep's round ``round``: wait for a free slot,
    tell the study the finished trials before it, ask its sampler for this round's trials."""
    from ddppipe.sweeps import rounds

    found = sweep.from_config(validate(json_config(config_json)))
    if found is None or found.method != "tpe":
        raise ConfigError("sweep-round: the config has no sweep of method tpe")
    doc = rounds.write_round(found, round, out)
    names = ", ".join(t["name"] for t in doc["trials"])
    after = f" ({doc['after_ended'][-1]} ended)" if doc["after_ended"] else ""
    print(f"sweep {found.name}: round {round} suggests {names}, its slot free after "
          f"{doc['waited_s']} s{after}")  # fmt: skip
    return 0
