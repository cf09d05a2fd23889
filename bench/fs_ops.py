"""Counting a folder tree's metadata operations with Linux's inotify (ctypes, no package).

:class:`Watcher` watches every folder under a root (folders made later too, from when they
appear) and keeps each event it sees with its time: opens (``IN_OPEN``, files and folders: a
listing opens its folder), creates, deletes and renames (``IN_MOVED_FROM``), the operations a
shared filesystem's metadata server serves; and writes (``IN_MODIFY``, "modify": data, not
counted, but they date a file's activity). (inotify sees this machine's operations only:
the SLURM test cluster's "nodes" share this host's filesystem, so it sees them all.)

    with Watcher(Path("results")) as watcher:
        ...
    print(watcher.counts(start, end))
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import select
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

IN_MODIFY = 0x002
IN_OPEN = 0x020
IN_MOVED_FROM = 0x040
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_ISDIR = 0x40000000
IN_IGNORED = 0x8000
IN_Q_OVERFLOW = 0x4000
KINDS = {IN_OPEN: "open", IN_CREATE: "create", IN_DELETE: "delete", IN_MOVED_FROM: "rename",
         IN_MODIFY: "modify"}  # fmt: skip
METADATA = ("open", "create", "delete", "rename")  # (a write's "modify" is data, not metadata)
MASK = IN_OPEN | IN_CREATE | IN_DELETE | IN_MOVED_FROM | IN_MODIFY
_EVENT = struct.Struct("iIII")


@dataclass(frozen=True)
class Event:
    at: float  # time.monotonic()
    kind: str  # open | create | delete | rename | modify
    path: str  # relative to the root


class Watcher:
    """Every metadata operation under ``root`` from :meth:`start` to :meth:`stop`."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root).resolve()
        self.events: list[Event] = []
        self._libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        self._fd = -1
        self._dirs: dict[int, Path] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Watcher:
        self._fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        self.root.mkdir(parents=True, exist_ok=True)
        self._watch_tree(self.root)
        self._drain()
        self.events.clear()  # (the watch's own listing of the tree)
        self._thread = threading.Thread(target=self._run, name="fs-ops", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching, with every event queued until now."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._fd >= 0:
            self._drain()
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> Watcher:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 trace: TracebackType | None) -> None:  # fmt: skip
        self.stop()

    def _watch(self, folder: Path) -> None:
        wd = self._libc.inotify_add_watch(self._fd, os.fsencode(folder), MASK)
        if wd >= 0:
            self._dirs[wd] = folder
        elif ctypes.get_errno() not in (errno.ENOENT, errno.ENOTDIR):
            raise OSError(ctypes.get_errno(), f"inotify_add_watch {folder}")

    def _watch_tree(self, folder: Path) -> None:
        self._watch(folder)
        for path, dirs, _ in os.walk(folder):
            for name in dirs:
                self._watch(Path(path) / name)

    def _run(self) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select([self._fd], [], [], 0.2)
            if ready:
                self._drain()

    def _drain(self) -> None:
        """Every event queued now."""
        while True:
            try:
                data = os.read(self._fd, 1 << 16)
            except BlockingIOError:
                return
            now, offset = time.monotonic(), 0
            while offset < len(data):
                wd, mask, _, size = _EVENT.unpack_from(data, offset)
                name = data[offset + _EVENT.size : offset + _EVENT.size + size].rstrip(b"\0")
                offset += _EVENT.size + size
                if mask & IN_Q_OVERFLOW:
                    raise OSError("inotify's queue overflowed: events were lost")
                folder = self._dirs.get(wd)
                if folder is None or mask & IN_IGNORED:
                    continue
                path = folder / os.fsdecode(name) if name else folder
                if mask & IN_CREATE and mask & IN_ISDIR:
                    self._watch(path)  # (not listed: that would count; what it holds is missed)
                for bit, kind in KINDS.items():
                    if kind == "open" and mask & IN_ISDIR and name:
                        continue  # (a watched folder's open: its own watch reports it too)
                    if mask & bit:
                        self.events.append(Event(now, kind, str(path.relative_to(self.root))))

    def between(self, start: float, end: float) -> list[Event]:
        return [e for e in self.events if start <= e.at < end]

    def counts(self, start: float = 0.0, end: float = float("inf")) -> Counter[str]:
        """The metadata operations of each kind in [start, end) (all by default)."""
        return Counter(e.kind for e in self.between(start, end) if e.kind in METADATA)
