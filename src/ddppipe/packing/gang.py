"""A multi-node trial's slots on several nodes of one allocation: its gang.

The allocation's first node leads: one of its free slots takes the trial and opens the gang,
a folder ``gangs/<job>/<run>/`` in the pool that names the leading slot and the seats the
trial still needs (``launch.nnodes`` - 1). A free slot of another node takes a seat before it
takes a trial of its own: one numbered file, linked in place (a seat is never taken twice, a
node takes one seat of a gang). Once every seat is taken, the leader launches the trial on
the seats' nodes (:class:`ddppipe.slurm.placement.Placement`). Removing the folder (the trial
ended, or went back to the queue) frees the seats: their nodes see it gone.

One node leads every gang, so two gangs never wait for each other's seats.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import urllib.parse
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ddppipe.core import atomic
from ddppipe.packing.pool import Pool, Ticket
from ddppipe.slurm.placement import Placement


@dataclass(frozen=True)
class Seat:
    """One node's slot in a gang: where it is, and its CPUs and GPUs."""

    node: str
    slot: int
    cpus: list[int]
    gpus: list[str]

    @property
    def name(self) -> str:
        return f"{self.node}/{self.slot}"


@dataclass(frozen=True)
class Gang:
    """A multi-node trial's gang folder."""

    folder: Path

    @classmethod
    def open(cls, pool: Pool, job: str, ticket: Ticket, leader: Seat) -> Gang:
        """(The leading node) Open the gang of ``ticket``'s trial, led by ``leader``."""
        folder = _gangs(pool, job) / urllib.parse.quote(ticket.run, safe="")
        folder.mkdir(parents=True, exist_ok=True)
        atomic.write_json(folder / "gang.json", {"run": ticket.run, "seats": ticket.nodes - 1,
                                                 "leader": asdict(leader)})  # fmt: skip
        return cls(folder)

    def _about(self) -> dict[str, Any] | None:
        try:
            return json.loads((self.folder / "gang.json").read_text())
        except (FileNotFoundError, ValueError):
            return None

    @property
    def is_open(self) -> bool:
        """False once the leader removed it (the trial ended or went back)."""
        return self.folder.is_dir()

    @property
    def run(self) -> str:
        about = self._about()
        return about["run"] if about else ""

    def seats(self) -> list[Seat]:
        """The seats taken, in their order."""
        taken = []
        for k in range(1, (self._about() or {}).get("seats", 0) + 1):
            with contextlib.suppress(FileNotFoundError, ValueError):
                taken.append(Seat(**json.loads((self.folder / f"seat-{k}.json").read_text())))
        return taken

    @property
    def full(self) -> bool:
        about = self._about()
        return about is not None and len(self.seats()) == about["seats"]

    def sit(self, seat: Seat) -> bool:
        """(Another node's free slot) Take a seat of this gang; False when none is left (or
        this node has one already)."""
        about = self._about()
        if about is None or any(s.node == seat.node for s in self.seats()):
            return False
        draft = self.folder / f".seat-{seat.node}-{seat.slot}.json"
        try:
            atomic.write_json(draft, asdict(seat))
        except FileNotFoundError:  # the gang closed meanwhile
            return False
        try:
            for k in range(1, about["seats"] + 1):
                try:
                    os.link(draft, self.folder / f"seat-{k}.json")
                    return True
                except FileExistsError:
                    continue
            return False
        except FileNotFoundError:
            return False
        finally:
            draft.unlink(missing_ok=True)

    def _slots(self) -> list[Seat]:
        """The leader's slot, then each seat's; none once the gang is gone."""
        about = self._about()
        return [Seat(**about["leader"]), *self.seats()] if about else []

    def placement(self) -> Placement:
        """Where the trial runs: the leader's node first, then each seat's."""
        slots = self._slots()
        assert slots, f"gang {self.folder} is gone"
        job = self.folder.parent.name  # (gangs/<job>/<run>)
        return Placement(job, [s.node for s in slots], {s.node: s.cpus for s in slots},
                         {s.node: s.gpus for s in slots})  # fmt: skip

    def slots(self) -> str:
        """The slots it holds, for the attempt history: ``cn07/0+cn08/1``."""
        return "+".join(s.name for s in self._slots())

    def close(self) -> None:
        """Free the seats: the trial ended, or went back to the queue. (Renamed first: the
        seats' nodes never see half a folder.)"""
        gone = self.folder.with_name(f".{self.folder.name}.closed")
        with contextlib.suppress(FileNotFoundError):
            os.rename(self.folder, gone)
        shutil.rmtree(gone, ignore_errors=True)


def open_gangs(pool: Pool, job: str) -> list[Gang]:
    """The gangs of allocation ``job`` still forming or training."""
    folder = _gangs(pool, job)
    found = sorted(folder.iterdir()) if folder.is_dir() else []
    return [Gang(path) for path in found if not path.name.startswith(".") and path.is_dir()]


def _gangs(pool: Pool, job: str) -> Path:
    return pool.root / "gangs" / job
