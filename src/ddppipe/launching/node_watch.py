"""A node lost while its step runs, found by the launcher of a job that survives it
(``slurm.spare_nodes``, ``slurm.min_nodes``: submitted with ``--no-kill``).

srun waits for the tasks of a failed node until SLURM declares the node down
(``SlurmdTimeout``, minutes at most sites), and a step with ``--no-kill`` is not ended by it.
So the launcher watches the step's nodes itself, through the nodes' records the hang watchdog
reads too (:mod:`ddppipe.launching.node_records`, each written by its node's agent every few
seconds: :mod:`ddppipe.training.measuring.node_summary`): a node is lost when its record has
stopped changing for :data:`SILENT_S` while the step is ending anyway (another node's agent
exited, a rank recorded a failure: the survivors of a lost peer fail at once), for
:data:`SILENT_ALONE_S` without such a sign (ranks blocked on a peer whose packets no longer
come), or when SLURM says it is down or not responding: asked once every
:data:`SCONTROL_EVERY_S` (a site's controller is asked about once a minute at most), and at
once when a node's record falls silent for :data:`QUIET_S`. The failures folder is listed only
while a node is silent. The launcher then ends the step (:func:`ddppipe.launching.launch`)
and starts the next one on the nodes left. A crash of the user's code is no lost node: every
agent exits and says so.
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from collections.abc import Callable

from ddppipe.launching.node_records import READ_S, NodeRecords
from ddppipe.runstate import failures
from ddppipe.runstate.state import StateDir
from ddppipe.slurm import scontrol
from ddppipe.training.measuring.node_summary import REPORT_S

log = logging.getLogger(__name__)
SILENT_S = 10.0  # silent this long while a rank failed or an agent exited: lost
SILENT_ALONE_S = 60.0  # silent this long with no other sign
FIRST_BEAT_S = 300.0  # a node yet to beat (its agent starting: an image, staged data)
POLL_S = READ_S
SCONTROL_EVERY_S = 60.0
QUIET_S = 2 * REPORT_S  # a node's record missed: SLURM asked at once


class NodeWatch:
    """The watch of one step's ``hosts`` in ``job``; :attr:`lost` names the nodes it found
    lost, :attr:`why` says how. ``records``: the reader of the nodes' records the hang
    watchdog reads too (one of its own when None)."""

    def __init__(self, state: StateDir, job: str, hosts: list[str],
                 records: NodeRecords | None = None) -> None:  # fmt: skip
        self.state, self.job, self.hosts = state, job, list(hosts)
        self.lost: list[str] = []
        self.why = ""
        self.records = records
        self._silence: NodeRecords | None = None
        self._asked = 0.0
        self._quiet: set[str] = set()  # nodes SLURM was asked about as they fell silent
        self.slurm_calls = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def begin(self, launcher: str, now: float | None = None) -> None:
        """The step of slot ``launcher`` starts (``now``: its time, monotonic)."""
        self._asked = time.monotonic() if now is None else now
        records = self.records
        if records is None or records.launcher != launcher:
            records = NodeRecords(self.state.node_beats, launcher, self.hosts, self._asked)
        records.hosts = sorted(set(records.hosts) | set(self.hosts))
        records.listing = False  # (the step's nodes are known)
        records.started = self._asked
        self._silence = records

    def start(self, launcher: str, end_step: Callable[[], None]) -> None:
        """Watch the step of slot ``launcher`` in a thread; ``end_step`` when a node is lost."""
        self.begin(launcher)

        def loop() -> None:
            while not self._stop.wait(POLL_S):
                if self.check():
                    end_step()
                    return

        self._thread = threading.Thread(target=loop, name="ddppipe-node-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def check(self, now: float | None = None, ask_slurm: bool = False) -> list[str]:
        """The nodes lost so far (also kept in :attr:`lost`); SLURM asked when it is time or
        ``ask_slurm`` (the step ended)."""
        if self.lost or self._silence is None:
            return self.lost
        now = time.monotonic() if now is None else now
        silence = self._silence
        silence.update(now)
        quiet = {node: silence.silent_for(node, now) for node in self.hosts}
        why = {}
        if any(q >= SILENT_S for q in quiet.values()):
            ending = bool(silence.ended) or bool(failures.read_all(self.state.failures))
            after = " after the step's other ranks failed or ended" if ending else ""
            for node, seconds in quiet.items():
                bound = SILENT_S if ending else SILENT_ALONE_S
                if seconds >= (bound if node in silence.records else FIRST_BEAT_S):
                    why[node] = f"its agent silent {seconds:.0f} s{after}"
        fell_silent = {n for n, q in quiet.items() if q >= QUIET_S and n in silence.records}
        if ask_slurm or now - self._asked >= SCONTROL_EVERY_S or fell_silent - self._quiet:
            self._asked, self.slurm_calls = now, self.slurm_calls + 1
            self._quiet |= fell_silent
            for node, state in self._slurm_failed().items():
                why.setdefault(node, f"SLURM says {state}")
        self._quiet &= fell_silent  # (a node heard again: asked again when it falls silent)
        if why:
            self.lost = sorted(why)
            self.why = "; ".join(f"{node}: {text}" for node, text in sorted(why.items()))
            log.error("node lost in job %s: %s", self.job, self.why)
        return self.lost

    def others_ended(self) -> bool:
        """Have the agents of every node but the lost ones exited?"""
        ended = self._silence.ended if self._silence is not None else set()
        return set(self.hosts) - set(self.lost) <= ended

    def _slurm_failed(self) -> dict[str, str]:
        try:
            states = scontrol.node_states(self.hosts)
        except (OSError, subprocess.SubprocessError) as e:
            log.warning("scontrol show node failed (%s)", e)
            return {}
        return {n: states[n] for n in scontrol.failed_nodes(states)}
