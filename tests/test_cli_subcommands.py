"""The CLI table: every subcommand's function exists and takes exactly its parsed arguments."""

from __future__ import annotations

import argparse
import importlib
import inspect

import pytest

from ddppipe.cli.main import parser
from ddppipe.cli.subcommands import COMMANDS


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
