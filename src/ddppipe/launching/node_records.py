"""(The launcher) The nodes' records of a slot, read at most every :data:`READ_S`: one file a
node (:class:`ddppipe.runstate.node_beats.NodeRecord`), for the hang watchdog and the node watch
alike (one reader, shared by both).

A record whose count changed is a sign of life, noted in the launcher's own clock (no clock of
two nodes compared; a late filesystem delays a record, it never invents one).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from ddppipe.runstate.node_beats import NodeRecord

READ_S = 2.0  # the launcher reads every node's record at most this often


class NodeRecords:
    """The records of slot ``launcher``'s nodes in ``folder`` (``node-beats/``): those of
    ``hosts`` and, until the hang watchdog has heard of every rank (:attr:`listing`), any other
    the folder lists; ``started``: the slot's start (monotonic)."""

    def __init__(self, folder: Path, launcher: str, hosts: list[str] | None = None,
                 started: float | None = None) -> None:  # fmt: skip
        self.folder, self.launcher, self.hosts = Path(folder), launcher, list(hosts or [])
        self.started = time.monotonic() if started is None else started
        self.records: dict[str, NodeRecord] = {}
        self.changed_at: dict[str, float] = {}  # node -> when its count last changed
        self.read_at: float | None = None
        self.version = 0  # one up at each read that found a changed record
        self.listing = True  # list the folder for nodes not in ``hosts`` (until every rank is in)
        self.opens = 0  # files opened (the shared filesystem's load: bench/control_plane.py)
        self._lock = threading.Lock()

    def update(self, now: float | None = None, force: bool = False) -> bool:
        """Read every node's record unless the last read is under :data:`READ_S` old (or
        ``force``); whether a record changed."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if not force and self.read_at is not None and now - self.read_at < READ_S:
                return False
            self.read_at = now
            changed = False
            for node in self._nodes():
                record = NodeRecord.read(self.folder / node)
                self.opens += 1
                if record is None or record.launcher != self.launcher:
                    continue  # none yet, or an earlier slot's
                old = self.records.get(node)
                if old is None or (old.count, old.ended) != (record.count, record.ended):
                    self.records[node], self.changed_at[node] = record, now
                    changed = True
            self.version += changed
            return changed

    def _nodes(self) -> list[str]:
        """``hosts``, the nodes found so far, and while :attr:`listing` those the folder lists."""
        listed: list[str] = []
        if self.listing:
            try:
                listed = [p.name for p in self.folder.iterdir()]
                self.opens += 1
            except OSError:
                pass
        return sorted(set(self.hosts) | set(self.records) | set(listed))

    @property
    def ended(self) -> set[str]:
        """The nodes whose agent said it ended."""
        return {node for node, record in self.records.items() if record.ended}

    def silent_for(self, node: str, now: float | None = None) -> float:
        """Seconds since ``node``'s record last changed (since the slot's start before its
        first); 0 for a node whose agent ended."""
        record = self.records.get(node)
        if record is not None and record.ended:
            return 0.0
        return (time.monotonic() if now is None else now) - self.changed_at.get(node, self.started)
