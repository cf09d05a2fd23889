"""Weights & Biases tracking of one run, continued across requeues (rank 0; ``tracking.wandb``).

One W&B run per ddppipe run. Its id is minted by the run's first slot (the run's name and a
random token) and kept in the state folder (``StateDir.wandb_run_id``), the folder that
survives every requeue, world-size change and resume and belongs to this run alone; every slot
calls ``wandb.init(id=..., resume="allow")`` with it. W&B's files are under
``results/<run>/wandb/``. Offline, wandb (0.31) ignores ``resume`` and writes one
``offline-run-<time>-<id>`` folder per slot there, all with the run's id: ``wandb sync
results/<run>/wandb/offline-run-*`` uploads them one after the other, in start order, into the
one run.

Steps: W&B's step is the global step, and W&B refuses a step lower than the last it took
("step must only increase": a point re-logged after a resume would be dropped). So a point
reaches W&B only once the checkpoint that covers its step is committed
(:meth:`WandbLog.checkpointed`; :meth:`WandbLog.finish`, after the stop's or the last
checkpoint, sends the rest): a slot killed after its last checkpoint never sent its later
points, and the next slot, resumed there, logs them. None lost, none twice, the steps strictly
increasing over every slot and offline folder. The cost: W&B trails training by up to one
checkpoint interval (TensorBoard is live). W&B writes its ``.wandb`` file every
:data:`FLUSH_S` seconds: a slot killed outright (SIGKILL, a node failure) loses what it sent
in its last seconds.

A sweep's trial is a run of the W&B group named after the sweep (job type ``trial``), its
config the trial's (the values under ``trial.values``). The summary holds the outcome (the
final evaluation), the provenance (git commit, config hash, what trained) and the slot's
efficiency figures; the final weights are a reference artifact ``model`` (``file://`` to
``train/model.pt``, which ``ddppipe export`` copies byte for byte to ``export/model.pt``).

Tracking never stops training: the first error is logged as a warning and W&B is then off for
the rest of the process. ``wandb`` is imported on first use only (the first checkpoint).
"""

from __future__ import annotations

import logging
import re
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ddppipe.core import atomic, errors
from ddppipe.runstate.state import StateDir

log = logging.getLogger(__name__)

FLUSH_S = 2.0  # wandb's x_transaction_log_flush_interval: how often it writes its file
INIT_TIMEOUT_S = 60.0  # wandb.init's wait for its service (online: for the server)
MAX_PENDING = 1_000_000  # points held back beyond this (no checkpoint for long) are dropped
_BAD_ID_CHARS = re.compile(r"[^A-Za-z0-9_-]+")


def run_id(state: StateDir, run_name: str) -> str:
    """The W&B run id of the run whose state folder is ``state``: read, or minted and kept."""
    path = state.wandb_run_id
    if path.exists():
        return path.read_text().strip()
    slug = _BAD_ID_CHARS.sub("-", run_name).strip("-")[:40] or "run"
    found = f"{slug}-{secrets.token_hex(4)}"
    atomic.write_text(path, found + "\n")
    return found


class WandbLog:
    """Rank 0's W&B run of one ddppipe run: points held until their checkpoint commits."""

    def __init__(
        self, settings: Mapping[str, Any], state: StateDir, run_name: str,
        config: dict[str, Any], group: str | None = None, tags: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        """``settings``: ``tracking.wandb`` ({project, entity, mode}); ``config``: the run's
        config (W&B's config); ``group``: a trial's sweep; ``tags``: this slot's (the summary's
        ``tags``)."""
        self.settings, self.state, self.run_name = dict(settings), state, run_name
        self.config, self.group, self.tags = config, group, dict(tags or {})
        self.on = True
        self._run: Any = None
        self._pending: list[tuple[int, dict[str, float]]] = []
        self._sent = -1  # the last step sent: W&B takes only higher ones
        self._dropping = False

    def put(self, step: int, points: dict[str, float]) -> None:
        """Hold ``points`` at global ``step`` until a checkpoint covers it."""
        if not self.on:
            return
        if len(self._pending) >= MAX_PENDING or step <= self._sent:
            if not self._dropping:
                self._dropping = True
                log.warning("W&B: dropping points (step %d: no checkpoint for too long, or "
                            "not above the step already sent, %d)", step, self._sent)  # fmt: skip
            return
        self._pending.append((step, points))

    def checkpointed(self, step: int) -> None:
        """A checkpoint at global ``step`` is committed: send the points up to it."""
        self._guard(self._send, step)

    def summary(self, values: Mapping[str, Any]) -> None:
        """Set ``values`` (nested dicts kept) in the run's summary."""
        self._guard(lambda: self._open().summary.update(dict(values)))

    def model(self, path: Path, name: str = "model") -> None:
        """The final weights ``path``, as a reference artifact (``file://``, checksummed)."""
        self._guard(self._log_model, Path(path), name)

    def finish(self) -> None:
        """Send every point held, mark the run finished (this slot's part of it)."""
        if not self.on:
            return
        self._guard(self._send, None)
        if self._run is not None:
            self._guard(self._run.finish)
        self.on = False

    def _send(self, upto: int | None) -> None:
        """The held points at steps up to ``upto`` (None: all), one committed row a step."""
        due = [p for p in self._pending if upto is None or p[0] <= upto]
        self._pending = [p for p in self._pending if upto is not None and p[0] > upto]
        rows: dict[int, dict[str, float]] = {}
        for step, points in sorted(due, key=lambda p: p[0]):
            rows.setdefault(step, {}).update(points)
        if not rows:
            return
        run = self._open()
        for step, row in rows.items():
            run.log(row, step=step, commit=True)
            self._sent = step

    def _log_model(self, path: Path, name: str) -> None:
        import wandb

        artifact = wandb.Artifact(name, type="model", metadata={"run": self.run_name})
        artifact.add_reference(path.resolve().as_uri(), name=path.name)
        self._open().log_artifact(artifact)

    def _open(self) -> Any:
        """The W&B run of every slot (initialised on first use)."""
        if self._run is not None:
            return self._run
        import wandb

        folder = self.state.wandb
        folder.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=self.settings["project"], entity=self.settings.get("entity"),
            mode=self.settings.get("mode") or "offline", dir=folder.parent,
            id=run_id(self.state, self.run_name), resume="allow", name=self.run_name,
            group=self.group, job_type="trial" if self.group else "train",
            config=self.config, settings=_settings(wandb),
        )  # fmt: skip
        if self.tags:
            self._run.summary.update({"tags": self.tags})
        return self._run

    def _guard(self, call: Any, *args: Any) -> None:
        """``call(*args)``; its first error turns W&B off for this process (a warning)."""
        if not self.on:
            return
        try:
            call(*args)
        except Exception as e:
            self.on = False
            self._pending = []
            log.warning("W&B tracking off for this process: %s", errors.one_line(e))


def _settings(wandb: Any) -> Any:
    """wandb's settings: no console capture, its file written every FLUSH_S seconds."""
    wanted = {"console": "off", "init_timeout": INIT_TIMEOUT_S,
              "x_transaction_log_flush_interval": FLUSH_S}  # fmt: skip
    known = getattr(wandb.Settings, "model_fields", wanted)  # (a private setting may go)
    return wandb.Settings(**{k: v for k, v in wanted.items() if k in known})
