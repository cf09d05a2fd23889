"""The sweep subcommands."""

from __future__ import annotations

import json
from pathlib import Path

from ddppipe.core import atomic
from ddppipe.spec import sweep
from ddppipe.spec.commands import json_config
from ddppipe.spec.config import ConfigError, validate


def sweep_trials(config_json: str, out: Path) -> int:
    """``ddppipe sweep-trials``: the sweep's definition and its trials known now, as JSON (what
    the table lists), derived from the config as the workflow derived them."""
    found = sweep.from_config(validate(json_config(config_json)))
    if found is None:
        raise ConfigError("sweep-trials: the config has no sweep (sweep.name is null)")
    doc = {
        "name": found.name,
        "definition": found.definition(),
        "metric": found.metric,
        "direction": found.direction,
        "max_parallel": found.max_parallel,
        "prune": found.prune,
        "trials": [
            {"name": t.name, "run": t.run, "values": dict(t.values)} for t in sweep.trials(found)
        ],
    }
    atomic.write_text(out, json.dumps(doc, indent=1) + "\n")
    return 0
