"""Which of a task's ``task_args`` its ``prepare()`` reads: the task's ``PREPARE_ARGS``.

A task may declare them, a literal tuple of names at the top of its file::

    PREPARE_ARGS = ("test_fraction", "split_seed")

so that runs (a sweep's trials) whose values of these differ each get their own prepared data,
and runs that differ only in other arguments (``width``, ``lr``) share one preparation
(:mod:`ddppipe.settings.data_sets`). Without it every argument counts: correct, at the price of a
preparation for each distinct ``task_args``. Read from the source (no import, no torch), so
the workflow knows it when it is parsed; :func:`check` holds the imported task to it.
"""

from __future__ import annotations

import ast
from pathlib import Path
from types import ModuleType
from typing import Any

NAME = "PREPARE_ARGS"


class PrepareArgsError(ValueError):
    """``PREPARE_ARGS`` is not a literal tuple of argument names."""


def _literal(node: ast.AST, path: Path) -> tuple[str, ...]:
    try:
        value = ast.literal_eval(node)
    except ValueError:
        value = None
    if not isinstance(value, tuple | list) or not all(isinstance(v, str) for v in value):
        raise PrepareArgsError(
            f"{path}: {NAME} must be a literal tuple of task_args names, e.g. {NAME} = "
            '("test_fraction", "split_seed"): ddppipe reads it without importing the task'
        )
    return tuple(value)


def read(path: str | Path) -> tuple[str, ...] | None:
    """The ``task_args`` names the task file ``path`` declares its ``prepare()`` reads; None
    where it declares none (then all of them count). Raise PrepareArgsError."""
    path = Path(path)
    tree = ast.parse(path.read_text(), str(path))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == NAME for t in node.targets
        ):
            return _literal(node.value, path)
        named = isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
        if named and node.target.id == NAME and node.value is not None:  # type: ignore[union-attr]
            return _literal(node.value, path)  # type: ignore[union-attr]
    return None


def check(module: ModuleType, schema: dict[str, Any] | None) -> None:
    """Refuse a ``PREPARE_ARGS`` naming an argument the task's ``ARGS_SCHEMA`` does not have
    (a typo would share data between runs that need their own). Raise PrepareArgsError."""
    names = getattr(module, NAME, None)
    if names is None or schema is None or schema.get("additionalProperties", True) is not False:
        return
    unknown = sorted(set(names) - set(schema.get("properties", {})))
    if unknown:
        raise PrepareArgsError(
            f"{module.__file__}: {NAME} names {', '.join(unknown)}, which ARGS_SCHEMA does not "
            f"have (it has {', '.join(sorted(schema.get('properties', {})))}): fix the name"
        )
