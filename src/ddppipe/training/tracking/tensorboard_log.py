"""TensorBoard event files of one run, continued across requeues (``tracking.tensorboard``).

Event files are in ``log_dir``, the same folder for every slot (never keyed on a job id or a
time). Each slot opens its own writer at its first point with ``purge_step`` = that step, which
writes a ``SessionLog.START`` event: TensorBoard's Python loader (``EventAccumulator``,
``tensorboard --load_fast=false``) then drops every point of every tag at steps >= that step
from the earlier files. TensorBoard's default data server drops a series' points when its step
goes back, tag by tag, which gives the same result as long as a slot logs with the same
step-based cadence as the slot before it (a resumed slot replays every step from its
checkpoint). Readers that parse each event file on its own (``tbparse``) see the stale points.
Event files are append-only, one per writer, and so are safe on NFS/Lustre; this is ddppipe's
default tracking. ``tensorboard`` is imported on first use only.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# TensorBoard's writer thread writes pending points out at least this often.
FLUSH_SECONDS = 5
# A slot waits at most this long for its event file to sort after the files already there.
_ORDER_WAIT_MAX_S = 2.0
_EVENT_FILE = re.compile(r"events\.out\.tfevents\.(\d+)\.")


class TensorBoardLog:
    """This slot's writer into ``log_dir``, opened before training (:meth:`open`) or at the
    first point (its step the purge step)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = Path(log_dir)
        self._writer: Any = None

    def open(self, purge_step: int) -> None:
        """Open this slot's writer now (before training: its import and file are not a step's),
        forgetting earlier slots' points from ``purge_step`` on. Raises on any error."""
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir.mkdir(parents=True, exist_ok=True)
        _wait_to_sort_last(self.log_dir)
        self._writer = SummaryWriter(
            str(self.log_dir), purge_step=purge_step, max_queue=1000, flush_secs=FLUSH_SECONDS
        )
        _kept_open(self._writer)

    def log(self, step: int, points: dict[str, float], prefix: str = "") -> None:
        """Points at ``step``; test points are written out at once. Raises on any error."""
        from tensorboard.compat.proto.summary_pb2 import Summary

        if self._writer is None:
            self.open(step)
        # One event of every point (add_scalar makes one each, at ~0.1 ms apiece: a point of
        # train loss and learning rate every 10 steps cost a short step several percent).
        summary = Summary(value=[Summary.Value(tag=tag, simple_value=float(value))
                                 for tag, value in points.items()])  # fmt: skip
        self._writer._get_file_writer().add_summary(summary, step)
        if _is_test(prefix, points):
            self._writer.flush()

    def close(self) -> None:
        """Write out and close the writer, if this slot opened one. Raises on any error."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _kept_open(writer: Any) -> None:
    """Give ``writer``'s records one file kept open for the slot. TensorBoard's own writes
    through its stub filesystem, which opens the event file anew for every record it appends
    (one open and close a point: tens a second on the shared filesystem at a short step).
    Unbuffered: each record is written as it comes, so a killed slot loses no more than
    before. A TensorBoard whose writer is built otherwise keeps its own."""
    try:
        events = writer._get_file_writer().event_writer
        records, name = events._async_writer._writer, events._file_name
    except AttributeError:
        return
    events.flush()  # (the records queued so far written the old way first)
    records._writer = open(name, "ab", buffering=0)  # noqa: SIM115 (closed with the writer)


def _is_test(prefix: str, points: Mapping[str, float]) -> bool:
    return prefix == "test" or any(tag.startswith("test/") for tag in points)


def _wait_to_sort_last(log_dir: Path) -> None:
    """Make this slot's event file sort after the existing ones (its name starts with the second).

    TensorBoard reads a folder's event files in name order; a purge must come after the points
    it purges. Two slots within the same second (fast restarts, tests) would tie.
    """
    seconds = [int(m[1]) for p in log_dir.iterdir() if (m := _EVENT_FILE.match(p.name)) is not None]
    if not seconds:
        return
    delay = max(seconds) + 1 - time.time()
    if delay > _ORDER_WAIT_MAX_S:
        log.warning(
            "an event file in %s is %.0f s in the future (clock skew between nodes?): "
            "TensorBoard may show stale points of an earlier slot",
            log_dir,
            delay,
        )
    elif delay > 0:
        time.sleep(delay)
