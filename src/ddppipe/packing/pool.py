"""A packed sweep's pool folder (``results/sweeps/<sweep>/pack/``), on the shared filesystem:
the trials waiting (``queue/``), training (``running/``), ended (``done/``) and refused
(``refused/``), the allocations' records (``allocations/``) and the nodes they exclude (the
pool's bad-node record, ``excluded-nodes.json``: :mod:`ddppipe.slurm.bad_nodes`). Every move
is one atomic rename or write, so two slots never take the same trial and a killed process
leaves nothing half-written. Only the user may write the pool and its queue (their folders are
made without group or other write permission, whatever the umask); a slot takes only the
user's own tickets of the pool's sweep (:mod:`ddppipe.packing.tickets`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import stat
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ddppipe.core import atomic
from ddppipe.packing import tickets
from ddppipe.packing.tickets import Ticket, TicketError
from ddppipe.slurm.bad_nodes import BadNodes

log = logging.getLogger(__name__)


def _make(folder: Path) -> None:
    """``folder`` (and its parents), made writable by this user only when it is new."""
    if folder.is_dir():
        return
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(stat.S_IMODE(folder.stat().st_mode) & ~0o022)  # (a umask of 002 leaves g+w)


@dataclass(frozen=True)
class Pool:
    """The folder of one packed sweep's queue and allocations."""

    root: Path

    @property
    def queue(self) -> Path:
        return self.root / "queue"

    @property
    def running(self) -> Path:
        return self.root / "running"

    @property
    def done(self) -> Path:
        return self.root / "done"

    @property
    def allocations(self) -> Path:
        return self.root / "allocations"

    @property
    def refused(self) -> Path:
        """Tickets no slot runs, each with the reason (:func:`ddppipe.packing.tickets.read`)."""
        return self.root / "refused"

    @property
    def sweep(self) -> str:
        """The sweep whose trials the pool takes (``results/sweeps/<sweep>/pack``)."""
        return self.root.parent.name

    def check_writers(self) -> None:
        """TicketError when users other than this one could write tickets into the pool."""
        for folder in (self.root, self.queue):
            if folder.is_dir() and (why := tickets.open_to_others(folder)):
                raise TicketError(f"refusing the packed sweep's queue: {why}")

    def _path(self, folder: Path, run: str) -> Path:
        return folder / (urllib.parse.quote(run, safe="") + ".json")

    # -- the train rule's side ---------------------------------------------------------------

    @property
    def cost(self) -> Path:
        """What the allocations cost (:mod:`ddppipe.packing.allocation_cost`)."""
        return self.root / "cost.json"

    @property
    def closed(self) -> Path:
        """Left by the submitting Snakemake when its call ends: no trial will come, the
        allocations' idle nodes end at once."""
        return self.root / "closed"

    def put(self, ticket: Ticket) -> bool:
        """Queue ``ticket`` (an ended one's result cleared); False when the trial trains now
        (a call before this one queued it: wait for it)."""
        for folder in (self.root, self.queue, self.running, self.done, self.allocations):
            _make(folder)
        self.check_writers()
        self.closed.unlink(missing_ok=True)
        self._path(self.done, ticket.run).unlink(missing_ok=True)
        self._path(self.refused, ticket.run).unlink(missing_ok=True)
        if self._path(self.running, ticket.run).exists():
            return False
        atomic.write_json(self.queue / ticket.name, asdict(ticket))
        return True

    def result(self, run: str) -> dict[str, Any] | None:
        """The ended trial's record (``exit`` its launcher's status), None while it waits."""
        try:
            return json.loads(self._path(self.done, run).read_text())
        except (FileNotFoundError, ValueError):
            return None

    def refusal(self, run: str) -> str | None:
        """Why the ticket of ``run`` was refused (None: it was not)."""
        try:
            return json.loads(self._path(self.refused, run).read_text())["refused"]
        except (FileNotFoundError, ValueError, KeyError):
            return None

    def close(self, wait_s: float = 30.0) -> None:
        """No trial comes any more (the call ended): idle allocations give their nodes back;
        wait up to ``wait_s`` seconds for their nodes to record their end (their cost)."""
        if not self.root.is_dir():
            return
        self.closed.touch()
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and any(
            "ended" not in r for r in self.records(self.allocations / "nodes")
        ):
            time.sleep(0.2)

    def withdraw(self, run: str) -> None:
        """Take a trial that waits out of the queue (its train job was cancelled)."""
        self._path(self.queue, run).unlink(missing_ok=True)

    def waiting(self) -> int:
        """Slots the waiting trials need (a multi-node trial one on each of its nodes)."""
        return sum(r.get("nodes", 1) for r in self.records(self.queue))

    def training(self) -> int:
        """Slots the training trials hold."""
        return sum(r.get("nodes", 1) for r in self.records(self.running))

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """One process at a time decides whether to submit an allocation."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    # -- a slot's side -----------------------------------------------------------------------

    def take(self, slot: dict[str, Any], max_nodes: int = 1) -> Ticket | None:
        """The first waiting trial of at most ``max_nodes`` nodes in the sweep's order (then
        the oldest), now this slot's (an atomic rename: no other slot gets it); None when none
        waits. A ticket that is not the user's trial is set aside in ``refused/``, logged;
        TicketError when others could write the queue."""
        self.check_writers()
        waiting = []
        for path in self.queue.glob("*.json") if self.queue.is_dir() else []:
            with contextlib.suppress(FileNotFoundError):  # (another slot took it)
                found, why = tickets.read(path, self.sweep)
                if why is None:
                    waiting.append((tickets.of_record(found), found, path))
                else:
                    self._refuse(path, found, why)
        for ticket, found, path in sorted(waiting, key=lambda w: (w[0].order, w[0].queued)):
            if ticket.nodes > max_nodes:
                continue
            target = self.running / path.name
            try:
                os.rename(path, target)
            except FileNotFoundError:  # another slot took it
                continue
            atomic.write_json(target, {**found, "slot": slot, "started": time.time()})
            return ticket
        return None

    def _refuse(self, path: Path, found: Any, why: str) -> None:
        """Set the ticket ``path`` aside, never run: its content kept beside the reason."""
        log.error("refused a ticket of the packed sweep's queue: %s", why)
        _make(self.refused)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            atomic.write_json(self.refused / path.name, {"refused": why, "ticket": found})

    def finish(self, ticket: Ticket, record: dict[str, Any]) -> None:
        """The trial ended (``record``: its exit status, slot, start and end): tell its
        train job."""
        atomic.write_json(self._path(self.done, ticket.run), {"run": ticket.run, **record})
        self._path(self.running, ticket.run).unlink(missing_ok=True)

    def give_back(self, ticket: Ticket) -> None:
        """The trial stopped with its allocation (it checkpointed): it waits for the next
        slot, first in line."""
        os.rename(self._path(self.running, ticket.run), self._path(self.queue, ticket.run))

    def reclaim(self, held: list[str]) -> list[str]:
        """Trials whose allocation SLURM no longer holds (it ended before they could stop)
        back in the queue, first in line; their runs."""
        back = []
        for path in sorted(self.running.glob("*.json")) if self.running.is_dir() else []:
            with contextlib.suppress(FileNotFoundError, ValueError):
                found = json.loads(path.read_text())
                if found.get("slot", {}).get("job") not in held:
                    os.rename(path, self.queue / path.name)
                    back.append(found["run"])
        return back

    def stopping(self, job: str) -> bool:
        """Whether allocation ``job``'s nodes got its time-limit warning (it takes no trial
        any more: the next one may be submitted now)."""
        nodes = [r for r in self.records(self.allocations / "nodes") if r.get("job") == job]
        return bool(nodes) and all("stopping" in r or "ended" in r for r in nodes)

    def working_nodes(self, job: str) -> int:
        """Nodes of allocation ``job`` that take trials now (checked, not ending)."""
        out = {"preflight", "stopping", "ended"}
        nodes = self.records(self.allocations / "nodes")
        return sum(1 for r in nodes if r.get("job") == job and not out & r.keys())

    def expected(self) -> bool:
        """Whether an allocation of this pool may still take trials: one submitted whose nodes
        have not all recorded their end (queued, or running)."""
        ended: dict[str, bool] = {}
        for r in self.records(self.allocations / "nodes"):
            ended[r["job"]] = ended.get(r["job"], True) and "ended" in r
        jobs = [r["job"] for r in self.records(self.allocations) if "job" in r]
        return any(not ended.get(job, False) for job in jobs)

    @property
    def bad_nodes(self) -> BadNodes:
        """The nodes the pool's allocations exclude (its bad-node record, as a run has one)."""
        return BadNodes.in_folder(self.root)

    def failed_preflight(self) -> dict[str, list[Path]]:
        """The nodes whose preflight failed in an allocation of this pool since the last
        decision on them (:meth:`decided`), with their records."""
        found: dict[str, list[Path]] = {}
        for path, r in self._read(self.allocations / "nodes"):
            if r.get("preflight") and "bad_node" not in r:
                found.setdefault(r["node"], []).append(path)
        return found

    def decided(self, records: list[Path], reason: str) -> None:
        """The node records of failed preflights decided on (excluded or not: ``reason``).
        Their workers have ended (a node that fails takes no trial), so nothing else writes
        them."""
        for path in records:
            with contextlib.suppress(FileNotFoundError, ValueError):
                atomic.write_json(path, {**json.loads(path.read_text()), "bad_node": reason})

    def refuse_waiting(self, why: str) -> list[str]:
        """Refuse every waiting trial (its train job fails, saying ``why``); their runs."""
        refused = []
        for path, found in self._read(self.queue):
            self._refuse(path, found, why)
            if (self.refused / path.name).exists():  # (not taken by a slot meanwhile)
                refused.append(str(found.get("run", path.stem)))
        return refused

    def records(self, folder: Path) -> list[dict[str, Any]]:
        return [record for _, record in self._read(folder)]

    @staticmethod
    def _read(folder: Path) -> list[tuple[Path, dict[str, Any]]]:
        """The JSON records of ``folder`` with their files, by name; one that is gone or
        half-read (moved meanwhile) left out."""
        found = []
        for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
            with contextlib.suppress(FileNotFoundError, ValueError):
                found.append((path, json.loads(path.read_text())))
        return found
