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

from ddppipe.core import atomic
from ddppipe.runstate import preemption
from ddppipe.runstate.state import StateDir

FOLDER_ENV = "DDPPIPE_FINISHED_NODES"  # where the agents mark their nodes (set by the launcher)
NODE_ENV = "SLURMD_NODENAME"  # set by slurmd in every task: the node's SLURM name


def prepare(state: StateDir) -> dict[str, str]:
    """(Launcher, before the step) Forget earlier slots' marks; the agents' environment."""
    folder = state.finished_nodes.resolve()
    shutil.rmtree(folder, ignore_errors=True)
    return {FOLDER_ENV: str(folder)}


def mark() -> None:
    """(Agent, its ranks all exited 0) Mark this node finished in this slot."""
    folder, attempt = os.environ.get(FOLDER_ENV), os.environ.get(preemption.ATTEMPT_ENV)
    if folder and attempt:  # else not started by ddppipe launch
        node = os.environ.get(NODE_ENV) or socket.gethostname()
        atomic.write_text(Path(folder) / node, attempt + "\n")


def finished(state: StateDir, attempt: str) -> set[str]:
    """The nodes marked finished in slot ``attempt`` (preemption.ATTEMPT_ENV's value)."""
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
