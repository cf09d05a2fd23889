"""A packed trial's ticket, and the launch command a node builds from it.

A ticket names a trial of the sweep (its run, the prepared data it trains on, its kind and
nodes), never a command line: the node that runs it builds the command itself
(:func:`launch_command`, the train rule's own ``ddppipe launch``), so whoever could drop a
file in the queue could at most ask for a trial of the sweep to train. A ticket that is not
the user's, or names anything but a trial of the pool's sweep, is refused (:func:`read`).
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from ddppipe.core.errors import UserError
from ddppipe.settings import layout

KINDS = ("task", "script")
FIELDS = ("run", "data", "kind", "nodes", "order", "queued")
TAKEN = ("slot", "started")  # what a slot adds to a ticket it takes (kept when given back)
DATA_ROOT = "resources"  # every prepared data folder is resources/<name>


class TicketError(ValueError, UserError):
    """A trial's launch that a packed sweep's node would not run as given."""


@dataclass(frozen=True)
class Ticket:
    """A trial to train: its run, its prepared data folder (none for a script), its kind, its
    nodes, when it was queued and its place in the sweep (``order``: trials start in it)."""

    run: str
    data: str | None = None
    kind: str = "task"
    nodes: int = 1
    order: int = 0
    queued: float = field(default_factory=time.time)

    @property
    def name(self) -> str:
        """The ticket's file name: the run, quoted (a run has slashes)."""
        return urllib.parse.quote(self.run, safe="") + ".json"


def launch_command(ticket: Ticket) -> list[str]:
    """The trial's ``ddppipe launch``, its paths the run's (relative to the sweep's working
    folder, where the node's worker runs)."""
    files = layout.RunLayout(ticket.run)
    data = ["--data", ticket.data] if ticket.data else []
    result = "--outputs" if ticket.kind == "script" else "--checkpoint"
    return [
        sys.executable, "-m", "ddppipe", "launch", "--config", str(files.config), *data,
        "--state", str(files.state), result, str(files.train.result(ticket.kind)),  # type: ignore[arg-type]
        "--metrics", str(files.train.metrics), "--attempts", str(files.train.attempts),
        "--log", str(files.log("train")),
    ]  # fmt: skip


def _launch_options(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    for option in ("--config", "--data", "--state", "--checkpoint", "--outputs", "--metrics",
                   "--attempts", "--log"):  # fmt: skip
        parser.add_argument(option)
    start = argv.index("launch") + 1 if "launch" in argv else len(argv)
    try:
        options, rest = parser.parse_known_args(argv[start:])
    except argparse.ArgumentError as e:
        raise TicketError(f"a packed trial's launch command cannot be read: {e}") from None
    if start == len(argv) or rest:
        raise TicketError(f"not a ddppipe launch command of a trial: {' '.join(argv)}")
    return vars(options)


def of_launch(run: str, kind: str, nodes: int, order: int, argv: list[str]) -> Ticket:
    """The ticket of the train rule's launch command ``argv`` (``ddppipe launch ...``) of the
    trial ``run``; TicketError when the command is not the one its node will build."""
    given = _launch_options(argv)
    ticket = Ticket(run, given["data"], kind, nodes, order)
    built = _launch_options(launch_command(ticket))
    differing = [f"--{k} {given[k]} (its node gives {v})" for k, v in built.items()
                 if given[k] != v]  # fmt: skip
    if differing:
        raise TicketError(f"trial {run}'s launch command differs from the one its allocation's "
                          f"node builds: {'; '.join(differing)}")  # fmt: skip
    return ticket


def _plain_path(text: Any) -> bool:
    path = PurePosixPath(text) if isinstance(text, str) and text else None
    return path is not None and not path.is_absolute() and ".." not in path.parts


def read(path: Path, sweep: str) -> tuple[Any, str | None]:
    """The record of the queue file ``path`` of sweep ``sweep``'s pool, and why it is not run
    (None: it is): a file that is not the user's, or anything but a trial of the sweep."""
    info = path.lstat()  # (never follows a link, never opens a pipe)
    if not stat.S_ISREG(info.st_mode):
        return None, f"{path} is no plain file"
    if info.st_uid != os.getuid():
        return None, f"{path} is owned by uid {info.st_uid}, not by this user (uid {os.getuid()})"
    try:
        found = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        return None, f"{path} is no JSON"
    return found, _refusal(found, path, sweep)


def _refusal(found: Any, path: Path, sweep: str) -> str | None:
    if not isinstance(found, dict) or set(FIELDS) - set(found) or set(found) - {*FIELDS, *TAKEN}:
        return f"{path} is no ticket (a ticket holds {', '.join(FIELDS)}; no command)"
    run, data = found.get("run"), found.get("data")
    prefix = f"{layout.SWEEPS}/{sweep}/"
    if not (isinstance(run, str) and run.startswith(prefix) and _plain_path(run)
            and "/" not in run.removeprefix(prefix)):  # fmt: skip
        return f"{path} names {run!r}, no trial of sweep {sweep} ({prefix}<trial>)"
    if data is not None and not (_plain_path(data) and PurePosixPath(data).parts[0] == DATA_ROOT):
        return f"{path}: data {data!r} is no folder under {DATA_ROOT}/"
    if found["kind"] not in KINDS:
        return f"{path}: kind {found['kind']!r} is none of {', '.join(KINDS)}"
    least = {"nodes": 1, "order": 0, "queued": 0}
    for key, lowest in least.items():
        value = found[key]
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not number or value < lowest or (key != "queued" and not isinstance(value, int)):
            return f"{path}: {key} {value!r} is no {'time' if key == 'queued' else 'count'}"
    return None


def of_record(found: dict[str, Any]) -> Ticket:
    """The ticket of a queue file's checked record (:func:`read`)."""
    return Ticket(*(found[name] for name in FIELDS))


def open_to_others(folder: Path) -> str | None:
    """Why another user could write tickets into ``folder`` (None: only this user can): not
    the user's, or writable by its group or by everyone."""
    info = folder.lstat()
    mode = stat.filemode(info.st_mode)
    if info.st_uid != os.getuid():
        return f"{folder} ({mode}) is owned by uid {info.st_uid}, not by this user"
    if info.st_mode & 0o022:
        return (f"{folder} ({mode}) may be written by other users, who could queue trials "
                f"there: chmod go-w {folder}")  # fmt: skip
    return None
