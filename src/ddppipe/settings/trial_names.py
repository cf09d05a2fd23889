"""A sweep trial's name, derived from its values (``lr=0.01+batch_size=256``), so a person finds
it on disk and adding a value adds only the trials that have it.

A name survives every layer it passes: no comma (the SLURM plugin hands a job's wildcards to
the Snakemake inside the job as ``name=value,name=value``), no space, no character a shell,
squeue, TensorBoard or MLflow reads specially; names written before with ``,`` between the keys
are renamed once (:mod:`ddppipe.sweeps.legacy_names`).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

_SAFE = re.compile(r"[^A-Za-z0-9._+-]+")  # a value's characters kept in a name (others: _)
SEPARATOR = "+"  # between the keys of a trial's name
LEGACY_SEPARATOR = ","  # what names had between their keys before: the plugin cuts it
MAX_NAME = 120  # characters of a trial's name before it is shortened with a hash


def labels_of(keys: tuple[str, ...]) -> dict[str, str]:
    """Each key's label in a trial's name: its last part, or the whole path where two keys
    share their last part."""
    last = [k.split(".")[-1] for k in keys]
    return {k: (tail if last.count(tail) == 1 else k) for k, tail in zip(keys, last, strict=True)}


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return repr(value)
    if isinstance(value, int | float | str):
        return _SAFE.sub("_", str(value)) or "_"
    return _SAFE.sub("_", json.dumps(value, separators=(",", ":"), sort_keys=True)).strip("_")


def _digest(values: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:8]


def trial_name(values: Mapping[str, Any], labels: Mapping[str, str]) -> str:
    """``lr=0.01+batch_size=256``: each key's label and value, in the parameters' order."""
    name = SEPARATOR.join(f"{labels[k]}={_text(v)}" for k, v in values.items())
    if len(name) > MAX_NAME:
        name = f"{name[: MAX_NAME - 9]}-{_digest(values)}"
    return name


def distinct(points: Sequence[Mapping[str, Any]], keys: tuple[str, ...]) -> list[str]:
    """The names of trials of these values (a sweep's ``keys``, in order), each once: with
    their digest where two sets of values would share a name."""
    labels = labels_of(keys)
    names = [trial_name(p, labels) for p in points]
    clashes = {n for n in names if names.count(n) > 1}  # values that differ only in characters
    return [f"{n}-{_digest(p)}" if n in clashes else n for n, p in zip(names, points, strict=True)]


def value_name(values: Mapping[str, Any]) -> str:
    """A name for ``values`` (config keys by their dotted paths), as a trial's; with their
    digest where a value's text is not the value itself (characters replaced, a list)."""
    name = trial_name(values, labels_of(tuple(values)))
    lossy = any(
        not isinstance(v, int | float | str) or (isinstance(v, str) and (not v or _SAFE.search(v)))
        for v in values.values()
    )
    return f"{name}-{_digest(values)}" if lossy and not name.endswith(_digest(values)) else name


def current_name(name: str) -> str:
    """A trial's name as ddppipe writes it now: one recorded before (an Optuna journal's, a
    round file's, a folder's) had ``,`` between its keys, the only place a comma could be."""
    return name.replace(LEGACY_SEPARATOR, SEPARATOR)
