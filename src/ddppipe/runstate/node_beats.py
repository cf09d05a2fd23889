"""Where a node's ranks beat, and the one record a node reports them in.

A rank beats to its own node, never to the shared filesystem: a small file in a node-local
folder of the slot (:func:`local_folder`, in memory under ``/dev/shm``). The node's agent
(``ddppipe agent``; locally the launcher itself) reads them there and reports its node in one
record, ``node-beats/<node>`` in the run's state folder (:class:`NodeRecord`): its count (a
change is a sign of life), whether the agent ended, and each of its ranks' last beat, how long
it went without progress and whether that is past its allowance
(ddppipe.training.measuring.node_summary). The launcher reads one record a node
(ddppipe.launching.node_records): its hang watchdog and its node watch alike.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ddppipe.core import in_place, private

NODE_ENV = "SLURMD_NODENAME"  # set by slurmd in every task: the node's SLURM name
SHARED_MEMORY = Path("/dev/shm")
PAD_TO = 512  # a record is padded to a multiple of this (an in-place write: core.in_place)


def node() -> str:
    """This node's name: SLURM's in a step, else the host's."""
    return os.environ.get(NODE_ENV) or socket.gethostname()


def local_base() -> Path:
    """This user's folder of the slots' node-local folders: in memory (``/dev/shm``) where
    there is one, else in the temporary folder."""
    base = SHARED_MEMORY if os.access(SHARED_MEMORY, os.W_OK) else Path(tempfile.gettempdir())
    return base / f"ddppipe-{os.getuid()}"


def local_folder(launcher: str, node_name: str) -> Path:
    """The node-local folder of slot ``launcher``'s ranks on ``node_name`` (their beats and
    stack dumps), in :func:`local_base`. The node's name is part of it: SLURM test clusters
    run their "nodes" on one host."""
    slot_id = hashlib.sha1(launcher.encode()).hexdigest()[:12]
    return local_base() / f"{slot_id}-{node_name}"


def private_base() -> bool:
    """Make :func:`local_base`, private to this user; False when it cannot be made or fails
    :func:`ddppipe.core.private.problem` (a link, someone else's, open to others)."""
    base = local_base()
    with contextlib.suppress(OSError):
        base.mkdir(mode=0o700, exist_ok=True)
    return private.problem(base) is None


def make_local_folder(folder: Path) -> bool:
    """Make ``folder`` (:func:`local_folder`) in :func:`private_base`; False when it cannot
    be made or the base is someone else's (nothing beats then)."""
    with contextlib.suppress(OSError):
        if private_base():
            folder.mkdir(exist_ok=True)
            return True
    return False


@dataclass
class NodeRecord:
    """One node's report: its agent's sign of life and its ranks' progress."""

    launcher: str  # the slot's launcher (a record of another slot is not this slot's)
    node: str
    count: int  # reports so far: a change is a sign of life
    ended: bool = False  # the agent exited (whatever its exit)
    # each rank's last beat (heartbeat.Beat's fields), with "idle_s" (seconds without
    # progress, in the agent's clock, when written) and "late" (past its allowance)
    ranks: list[dict[str, Any]] = field(default_factory=list)

    def write(self, path: Path, size: int = 0) -> int:
        """One in-place write to ``path`` padded to ``size`` or more (whole multiples of
        :data:`PAD_TO`); the size written (0: it could not be)."""
        data = json.dumps(asdict(self), separators=(",", ":")).encode() + b"\n"
        size = max(size, -(-len(data) // PAD_TO) * PAD_TO)
        return size if in_place.write_padded(path, data, size) else 0

    @classmethod
    def read(cls, path: Path) -> NodeRecord | None:
        """The record in ``path``; None when there is none or it cannot be read now."""
        try:
            record, _ = json.JSONDecoder().raw_decode(Path(path).read_text().strip())
            return cls(**record)
        except (OSError, ValueError, TypeError):
            return None
