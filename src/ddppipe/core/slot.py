"""The slot record: what every process of a training slot must know about it.

The launcher writes it once, before it starts the ranks, into the run's state folder (shared
by a job's nodes) and points :data:`ddppipe.core.env_names.SLOT` at it; each process reads it
once (:func:`read`). A script that does not import ddppipe reads the same JSON file.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from ddppipe.core import atomic, env_names


@dataclass(frozen=True)
class Slot:
    """One slot of a run, as its launcher opened it."""

    run: str  # the run's name
    state: str  # the run's state folder (results/<run>/state), absolute
    attempt: int = 1  # 1, 2, ...: this slot's number in the run's attempt history
    launcher: str = ""  # "<job|local>:<host>:<pid>/<attempt>": whose a stop note or mark is
    start: float | None = None  # Unix time the launcher opened the slot
    end: float | None = None  # Unix time the job's time limit ends (None without one)
    stop_at: float | None = None  # Unix time a stop is due even without a signal
    stop_signal: str = "SIGUSR1"  # the time-limit warning's signal (slurm.stop_signal)
    device: str = ""  # gpu | cpu: the run spec's device
    strategy: str = "ddp"  # launch.strategy: ddp | fsdp | hsdp
    activation_checkpointing: bool = False  # train.activation_checkpointing
    tensorboard: str | None = None  # the run's TensorBoard folder (None when off)
    mlflow: str | None = None  # the MLflow tracking URI (None when off)
    user_file: str | None = None  # the task file or script whose frames name a failure
    nccl_trace: bool = False  # a GPU run: dump the NCCL flight recorder when asked
    checks: bool = False  # a SLURM job of its own: its ranks check their nodes and world first


def write(slot: Slot, path: Path) -> dict[str, str]:
    """Write ``slot`` to ``path`` (atomically); the environment variables that point at it and
    name its launcher (:func:`unseen`)."""
    atomic.write_json(path, asdict(slot))
    return {env_names.SLOT: str(Path(path).resolve()), env_names.SLOT_LAUNCHER: slot.launcher}


def unseen(env: Mapping[str, str] | None = None) -> str | None:
    """None when this node reads the slot record ``env`` points at as its launcher wrote it;
    else what it sees instead (a node without the run's shared state folder, or a stale view
    of it, reads none or an earlier slot's). Read afresh, not from :func:`read`'s cache."""
    env = os.environ if env is None else env
    path, launcher = env.get(env_names.SLOT), env.get(env_names.SLOT_LAUNCHER)
    if not path or launcher is None:
        return None  # no slot (a command by hand): nothing to compare
    try:
        found = json.loads(Path(path).read_text()).get("launcher")
    except (OSError, ValueError, AttributeError) as e:
        return f"{path}: {getattr(e, 'strerror', None) or e}"
    return None if found == launcher else f"{path} is another slot's ({found}, not {launcher})"


def read(env: Mapping[str, str] | None = None) -> Slot | None:
    """The slot record ``env`` (this process's environment) points at; None outside a slot."""
    path = (os.environ if env is None else env).get(env_names.SLOT)
    return _load(path) if path else None


@functools.cache
def _load(path: str) -> Slot:
    return Slot(**json.loads(Path(path).read_text()))
