"""The config subcommands' inputs: a config passed as JSON text, and the data rule's settings."""

from __future__ import annotations

import json
from pathlib import Path

from ddppipe.settings import config


def json_config(text: str) -> dict:
    """The ``--json`` argument (the rules pass the config as JSON text); raise ConfigError."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise config.ConfigError(f"--json: not JSON text ({e})") from e
    if not isinstance(value, dict):
        raise config.ConfigError(f"--json: expected a JSON object, got {type(value).__name__}")
    return value


def data_settings(json_text: str, out: Path) -> int:
    """``ddppipe data-settings``: write what a task's data depends on (task, task_args)."""
    config.write(json_config(json_text), out)  # the Snakefile validated the config
    return 0
