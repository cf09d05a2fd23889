"""Which nodes of a SLURM step saw all their ranks finish: srun's exit 0 alone does not say.

srun exits 0 when a node of its step fails ("srun: error: Node failure on cn07"): the ranks
there never finished. So each node's ``ddppipe agent`` marks its node once its ranks all
exited 0, and the launcher counts a step as complete only with every node's mark of this
slot. The marks live in the state folder (shared by the nodes), cleared before each step.
"""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

from ddppipe.core import atomic, slot
from ddppipe.runstate.state import StateDir

NODE_ENV = "SLURMD_NODENAME"  # set by slurmd in every task: the node's SLURM name


def prepare(state: StateDir) -> None:
    """(Launcher, before the step) Forget earlier slots' marks."""
    shutil.rmtree(state.finished_nodes, ignore_errors=True)


def mark() -> None:
    """(Agent, its ranks all exited 0) Mark this node finished in this slot (its record's)."""
    found = slot.read()
    if found is not None:  # else not started by ddppipe launch
        node = os.environ.get(NODE_ENV) or socket.gethostname()
        folder = StateDir(Path(found.state)).finished_nodes
        atomic.write_text(folder / node, found.launcher + "\n")


def finished(state: StateDir, attempt: str) -> set[str]:
    """The nodes marked finished in slot ``attempt`` (its launcher, the slot record's)."""
    try:
        marks = list(state.finished_nodes.iterdir())
    except FileNotFoundError:
        return set()
    return {p.name for p in marks if atomic.temp_target(p.name) is None and _read(p) == attempt}


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None
