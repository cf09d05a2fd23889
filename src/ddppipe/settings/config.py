"""Loading, validating and resolving the ddppipe configuration."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import re
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from ddppipe.core import atomic
from ddppipe.core.errors import UserError
from ddppipe.settings import layout, presets

log = logging.getLogger(__name__)

# Keys that change the numbers a training run produces. Anything else (process count,
# checkpoint interval, logging) may change between a run and its resumption.
HASHED_TRAIN_KEYS = (*presets.RECIPE_KEYS, "seed")


# Keys that earlier versions had, and where their setting lives now.
RENAMED = {
    "launch.threads_per_proc": "launch.cpus_per_proc",
    "slurm.cpus_per_task": "launch.cpus_per_proc",
    "scaling.cpus_per_task": "scaling.cpus_per_proc",
    "slurm.gpus_per_node": "launch.device (gpu: one GPU per process, nproc_per_node a node)",
    "launch.backend": "launch.device (NCCL on GPUs, gloo on CPUs)",
}

# Keys a user may guess that no version had, and the setting they mean.
GUESSED = {
    "launch.fsdp_hybrid": "launch.strategy: hsdp (sharded within a node, replicated across nodes)",
    "launch.hybrid": "launch.strategy: hsdp (sharded within a node, replicated across nodes)",
    "train.strategy": "launch.strategy (ddp, fsdp or hsdp)",
    "launch.activation_checkpointing": "train.activation_checkpointing",
}


# Top-level sections whose settings moved (told by the keys they held): where they live now.
MOVED = {
    "data": (("mirrors", "sha256", "timeout_s", "deadline_s", "max_bytes"),
             "the MNIST download settings (mirrors, sha256, timeout_s, deadline_s, max_bytes) "
             "are now task_args of the task ddppipe.tasks.mnist: rename data: to task_args:"),
}  # fmt: skip


class ConfigError(ValueError, UserError):
    """The configuration is invalid; the message says which key and why."""


@functools.cache
def _schema_text() -> str:
    """The schema as JSON text, parsed from its YAML once per process (the workflow validates
    every run's config: a 1,000-trial sweep parsed the YAML thousands of times)."""
    text = resources.files("ddppipe.settings").joinpath("config.schema.yaml").read_text()
    return json.dumps(yaml.safe_load(text))


def schema() -> dict[str, Any]:
    """The config schema (a fresh copy: callers may change it)."""
    return json.loads(_schema_text())


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


@functools.cache
def _defaults_validator() -> type:
    """The validator class that fills defaults, made once (not for every config checked)."""
    return _fill_defaults(jsonschema.Draft202012Validator)


_NULL_WORDS = frozenset({"null", "~"})  # YAML's spellings of null
_BOOL_WORDS = {"true": True, "false": False, "yes": True, "no": False}


def _types(node: dict[str, Any]) -> set[str]:
    """The JSON types a schema node admits (from ``type``, or from its ``enum`` values)."""
    declared = node.get("type")
    if declared is not None:
        return {declared} if isinstance(declared, str) else set(declared)
    names = {type(None): "null", bool: "boolean", int: "integer", float: "number", str: "string"}
    return {names[type(v)] for v in node.get("enum", []) if type(v) in names}


def _coerce_text(text: str, types: set[str]) -> Any:
    """``text`` as the first of ``types`` it spells; raise ValueError when it spells none."""
    if "null" in types and text.strip() in _NULL_WORDS:
        return None
    if "string" in types:
        return text
    if "boolean" in types and text.strip().lower() in _BOOL_WORDS:
        return _BOOL_WORDS[text.strip().lower()]
    if "integer" in types:
        with contextlib.suppress(ValueError):
            return int(text)
    if "number" in types:
        with contextlib.suppress(ValueError):
            return float(text)
    if types & {"array", "object"}:
        parsed = yaml.safe_load(text)
        if isinstance(parsed, list | dict):
            return parsed
    raise ValueError(f"{text!r} is not of type {' or '.join(sorted(types))}")


def coerce(value: Any, node: dict[str, Any], where: str = "") -> Any:
    """``value`` with text turned into the types the schema ``node`` asks for.

    Snakemake 9 parses nested ``--config`` values with YAML's BaseLoader, so
    ``--config 'launch={nnodes: 2}'`` arrives as ``{"nnodes": "2"}``; this makes it 2.
    A text that spells no wanted type is left as it is, for the schema to report.
    """
    if isinstance(value, dict):
        for alternative in node.get("anyOf", []):  # the object alternative with these keys
            if alternative.get("type") == "object" and set(alternative.get("required", ())) <= set(
                value
            ):
                node = alternative
                break
        props, patterns = node.get("properties", {}), node.get("patternProperties", {})
        extra = node.get("additionalProperties")
        for key, sub in value.items():
            child = props.get(key) or next(
                (s for pattern, s in patterns.items() if re.search(pattern, str(key))), None
            )
            if child is None and isinstance(extra, dict):
                child = extra
            if child is not None:
                value[key] = coerce(sub, child, f"{where}.{key}" if where else str(key))
        return value
    if isinstance(value, list):
        items = node.get("items")
        if not isinstance(items, dict):
            return value
        return [coerce(v, items, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, str) and "anyOf" in node:  # e.g. a number or "auto": the first fit
        for alternative in node["anyOf"]:
            if (coerced := coerce(value, alternative, where)) is not value:
                return coerced
        return value
    types = _types(node)
    nullable = "null" in types and isinstance(value, str) and value.strip() in _NULL_WORDS
    if isinstance(value, str) and types and ("string" not in types or nullable):
        try:
            value = _coerce_text(value, types)
        except ValueError:
            return value  # left for the schema to report, with every other error
        return coerce(value, node, where) if isinstance(value, list | dict) else value
    if types == {"string"} and isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    return value


def _renamed(cfg: dict[str, Any]) -> list[str]:
    """Lines for keys that moved (old configs), saying where their setting lives now."""
    lines = [f"  {old}: {why}" for old, (keys, why) in MOVED.items()
             if isinstance(cfg.get(old), dict) and set(keys) & set(cfg[old])]  # fmt: skip
    for old, new in RENAMED.items():
        section, key = old.split(".")
        if isinstance(cfg.get(section), dict) and key in cfg[section]:
            lines.append(f"  {old}: this key is now {new}; rename it")
    for guess, meant in GUESSED.items():
        section, key = guess.split(".")
        if isinstance(cfg.get(section), dict) and key in cfg[section]:
            lines.append(f"  {guess}: no such key; set {meant}")
    return lines


def _hint(error: jsonschema.ValidationError, schema_: dict[str, Any]) -> str:
    """What the schema says the value must be, when its message does not."""
    if error.validator == "type" and isinstance(error.instance, str):
        return " (command-line values are text)"
    if error.validator in ("pattern", "anyOf") and error.parent is None:
        described = _described(error, schema_)
        return f": {described}" if described else ""
    return ""


def _described(error: jsonschema.ValidationError, schema_: dict[str, Any]) -> str | None:
    """The description of the nearest schema node above ``error`` (an item's is its list's)."""
    node: Any = schema_
    found = node.get("description")
    for key in error.absolute_schema_path:
        if not isinstance(node, dict | list):
            break
        node = node[key] if isinstance(node, list) or key in node else None
        if isinstance(node, dict) and node.get("description"):
            found = node["description"]
    return " ".join(found.split()) if found else None


def _checked(value: Any, schema_: dict[str, Any], where: str) -> tuple[Any, list[str]]:
    """``value`` coerced and filled with ``schema_``'s defaults, and a line per error."""
    value = coerce(value, schema_, where)
    validator = _defaults_validator()(schema_)
    errors = sorted(validator.iter_errors(value), key=lambda e: list(e.absolute_path))
    lines = []
    for e in errors:
        key = ".".join([*([where] if where else []), *map(str, e.absolute_path)])
        lines.append(f"  {key or '(top level)'}: {e.message}{_hint(e, schema_)}")
    return value, lines


def validate(cfg: dict[str, Any]) -> dict[str, Any]:
    """Coerce, validate ``cfg`` in place against the schema, fill defaults; raise ConfigError."""
    cfg, lines = _checked(cfg, schema(), "")
    if lines:
        raise ConfigError(
            "invalid configuration:\n"
            + "\n".join([*_renamed(cfg), *lines])
            + "\nSee docs/configuration.md."
        )
    return cfg


def validate_against(value: Any, schema_: dict[str, Any], where: str) -> Any:
    """``value`` coerced, checked against ``schema_`` and filled with its defaults."""
    value, lines = _checked(value, schema_, where)
    if lines:
        raise ConfigError("invalid configuration:\n" + "\n".join(lines))
    return value


def load(path: str | Path) -> dict[str, Any]:
    """Read a YAML config file and validate it."""
    with open(path) as f:
        cfg = yaml.safe_load(f)
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path}: expected a YAML mapping at the top level")
    return validate(cfg)


DATA_KEYS = ("task", "task_args")  # what a task's data depends on: nothing of any run
# ... and, where it is not its default, how it is stored (absent: the settings files, and so
# the prepared data, of configs from before it stay as they were).
PACK_KEY = "data"


def data_settings(cfg: dict[str, Any]) -> dict[str, Any]:
    """The settings a task's prepared data depends on (the data rule's input)."""
    packed = (cfg.get(PACK_KEY) or {}).get("pack", "none") != "none"
    return {key: cfg[key] for key in DATA_KEYS + ((PACK_KEY,) if packed else ())}


def load_data_settings(path: str | Path) -> dict[str, Any]:
    """Read the data rule's settings file (``task:``, ``task_args:``, ``data:`` where packed)
    and check its shape; ``data`` filled in."""
    with open(path) as f:
        doc = yaml.safe_load(f)
    props = schema()["properties"]
    if not isinstance(doc, dict) or not set(DATA_KEYS) <= set(doc) <= {*DATA_KEYS, PACK_KEY}:
        raise ConfigError(
            f"{path}: expected a YAML mapping of {', '.join(DATA_KEYS)} (and {PACK_KEY})"
        )
    return {key: validate_against(doc.get(key, {}), props[key], key)
            for key in (*DATA_KEYS, PACK_KEY)}  # fmt: skip


def world_size(cfg: dict[str, Any]) -> int:
    """World size of the run the config describes (nodes x processes per node)."""
    launch = cfg["launch"]
    return launch["nnodes"] * launch["nproc_per_node"]


def resolve(cfg: dict[str, Any], gpus: bool) -> dict[str, Any]:
    """A validated copy of ``cfg`` with the training recipe (and the task arguments the preset
    sets) filled in from its preset, and the device decision under ``resolved``.

    ``gpus``: whether the run trains on GPUs, as :func:`ddppipe.parallel.devices.trains_on_gpus`
    decided it; it picks the preset's GPU version. Nothing here reads this machine's CPU: the
    ``fast`` preset's ``precision: auto`` is decided by the devices that train
    (:mod:`ddppipe.parallel.precision`), so the result is the same on every machine.
    The typed form of the result: :class:`ddppipe.settings.run_spec.RunSpec`.
    """
    cfg = validate(json.loads(json.dumps(cfg)))
    ws = world_size(cfg)
    strategy = cfg["launch"]["strategy"]
    if cfg["train"].get("channels_last") and strategy in presets.SHARDED:
        raise ConfigError(
            f"train.channels_last: true with launch.strategy {strategy}: FSDP2 shards only "
            "contiguous parameters, and channels_last makes a convolution's weights "
            "non-contiguous; set train.channels_last: false (or leave it null: the preset's "
            "value is then left out), or use launch.strategy: ddp"
        )
    cfg["train"] = presets.resolve(cfg["train"], ws, gpus, strategy)
    if layout.kind(cfg) == "task":
        cfg["task_args"] = presets.task_args(cfg["train"]["preset"], cfg["task"], cfg["task_args"])
    if cfg["train"]["batch_size"] % ws:
        raise ConfigError(
            f"train.batch_size {cfg['train']['batch_size']} is the global batch and must be "
            f"divisible by the world size {ws}; choose a multiple of {ws}"
        )
    cfg["resolved"] = {"device": "gpu" if gpus else "cpu"}
    return cfg


def load_resolved(path: str | Path) -> dict[str, Any]:
    """A config that :func:`resolve` wrote (every recipe key filled in); raise ConfigError."""
    cfg = load(path)
    missing = [f"train.{k}" for k in presets.RECIPE_KEYS if cfg["train"][k] is None]
    missing += ["resolved"] if cfg["resolved"] is None else []
    if missing:
        raise ConfigError(
            f"{path}: {', '.join(missing)} null: this config was never resolved. "
            "Training reads results/<run>/config.yaml, which the workflow writes; by hand, run "
            f"`ddppipe resolve-config --config {path} --out RESOLVED.yaml` and use that"
        )
    return cfg


def train_hash(cfg: dict[str, Any], data_digest: str) -> str:
    """Short hash of everything that determines a training run's numbers.

    ``data_digest``: the data manifest's (:mod:`ddppipe.data.manifest`).
    """
    keyed = {k: cfg["train"][k] for k in HASHED_TRAIN_KEYS}
    if cfg["train"].get("deterministic"):  # other kernels: only then (existing hashes kept)
        keyed["deterministic"] = True
    keyed["data"] = data_digest
    keyed["task"] = (cfg["task_source"] or {}).get("sha256")
    keyed["task_args"] = cfg["task_args"]
    blob = json.dumps(keyed, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def write(cfg: dict[str, Any], path: str | Path) -> None:
    """Write a config as YAML, atomically."""
    atomic.write_text(path, yaml.safe_dump(cfg, sort_keys=False))
