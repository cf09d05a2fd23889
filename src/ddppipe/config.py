"""Loading, validating and resolving the ddppipe configuration."""

from __future__ import annotations

import hashlib
import json
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from ddppipe import atomic, presets

# Keys that change the numbers a training run produces. Anything else (process count,
# checkpoint interval, logging) may change between a run and its resumption.
HASHED_TRAIN_KEYS = (*presets.RECIPE_KEYS, "seed")


class ConfigError(ValueError):
    """The configuration is invalid; the message says which key and why."""


def schema() -> dict[str, Any]:
    text = resources.files("ddppipe").joinpath("config.schema.yaml").read_text()
    return yaml.safe_load(text)


def _fill_defaults(validator_class: type) -> type:
    """A validator class that also writes each property's schema default into the instance."""
    validate_properties = validator_class.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, schema_):
        if isinstance(instance, dict):
            for prop, sub in properties.items():
                if "default" in sub:
                    instance.setdefault(prop, sub["default"])
        yield from validate_properties(validator, properties, instance, schema_)

    return jsonschema.validators.extend(validator_class, {"properties": set_defaults})


def validate(cfg: dict[str, Any]) -> dict[str, Any]:
    """Validate ``cfg`` in place against the schema, filling defaults; raise ConfigError."""
    validator = _fill_defaults(jsonschema.Draft202012Validator)(schema())
    errors = sorted(validator.iter_errors(cfg), key=lambda e: list(e.absolute_path))
    if errors:
        lines = []
        for e in errors:
            where = ".".join(str(p) for p in e.absolute_path) or "(top level)"
            lines.append(f"  {where}: {e.message}")
        raise ConfigError(
            "invalid configuration:\n" + "\n".join(lines) + "\nSee README.md (Configuration)."
        )
    return cfg


def load(path: str | Path) -> dict[str, Any]:
    """Read a YAML config file and validate it."""
    with open(path) as f:
        cfg = yaml.safe_load(f)
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path}: expected a YAML mapping at the top level")
    return validate(cfg)


def world_size(cfg: dict[str, Any]) -> int:
    """World size of the run the config describes (nodes x processes per node)."""
    launch = cfg["launch"]
    return launch.get("nnodes", 1) * launch["nproc_per_node"]


def resolve(cfg: dict[str, Any]) -> dict[str, Any]:
    """A validated copy of ``cfg`` with the training recipe filled in from its preset."""
    cfg = validate(json.loads(json.dumps(cfg)))
    ws = world_size(cfg)
    cfg["train"] = presets.resolve(cfg["train"], ws)
    if cfg["train"]["batch_size"] % ws:
        raise ConfigError(
            f"train.batch_size {cfg['train']['batch_size']} is the global batch and must be "
            f"divisible by the world size {ws}; choose a multiple of {ws}"
        )
    return cfg


def train_hash(cfg: dict[str, Any]) -> str:
    """Short hash of everything that determines a training run's numbers."""
    keyed = {k: cfg["train"][k] for k in HASHED_TRAIN_KEYS}
    keyed["data"] = cfg["data"]["sha256"]
    blob = json.dumps(keyed, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def write(cfg: dict[str, Any], path: str | Path) -> None:
    """Write a config as YAML, atomically."""
    atomic.write_text(path, yaml.safe_dump(cfg, sort_keys=False))
