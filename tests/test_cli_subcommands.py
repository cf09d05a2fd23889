"""The CLI table: every subcommand's function exists and takes exactly its parsed arguments."""

from __future__ import annotations

import argparse
import importlib
import inspect
import tomllib

import pytest

from ddppipe.cli.main import parser
from ddppipe.cli.subcommands import COMMANDS
from tests.tiny import REPO


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return actions[0].choices


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.name)
def test_function_takes_the_arguments(command) -> None:
    module, _, name = command.call.partition(":")
    function = getattr(importlib.import_module(module), name)
    dests = {a.dest for a in _subparsers()[command.name]._actions if a.dest != "help"}
    assert set(inspect.signature(function).parameters) == dests


def test_names_are_unique() -> None:
    assert len({c.name for c in COMMANDS}) == len(COMMANDS) == len(_subparsers())


def test_every_function_named_by_string_is_in_a_layer_the_cli_may_import() -> None:
    """The table names its functions as text (imported on use), which lint-imports cannot
    see: each must be in the cli or a package below it in the layer contract."""
    layers = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = [c for c in layers["contracts"]
                   if c["type"] == "layers" and "ddppipe.cli" in c["layers"]]  # fmt: skip
    below = contract["layers"][contract["layers"].index("ddppipe.cli") :]
    assert below[:2] == ["ddppipe.cli", "ddppipe.sweeps"]  # the layers read as expected
    outside = [c.call for c in COMMANDS
               if ".".join(c.call.split(":")[0].split(".")[:2]) not in below]  # fmt: skip
    assert outside == []
