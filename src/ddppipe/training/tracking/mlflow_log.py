"""MLflow tracking of one run, continued across requeues (rank 0; only with ``tracking.mlflow``).

Every slot logs into the same MLflow run. Its id is minted by the server when the first slot
creates the run and kept in the state folder (``StateDir.mlflow_run_id``), next to the
checkpoints, because that folder is what survives a requeue and belongs to this run alone (a job
id or a run name would not identify it). MLflow cannot delete points: after a resume at step S
its history holds the stale points at steps >= S as well as the new ones (for a step logged
twice, the later timestamp is the valid value); the run's latest value of a metric is the new
slot's.

ddppipe sets no MLflow default. Recommended tracking URIs: on a cluster, an ``http://``
tracking server (``mlflow server`` on the login node, its backend store on a local disk of that
node); on a laptop, ``sqlite:///`` on a local disk. Avoid ``sqlite:///`` on NFS/Lustre
(SQLite's locking is unsafe there) and MLflow's file store (deprecated in MLflow 3). The
experiment is ``$MLFLOW_EXPERIMENT_NAME``, else ``ddppipe``. MLflow calls run in a background
thread, so a slow or dead server never stalls training; its first error is logged as a warning
and MLflow is then off for the rest of the process. ``mlflow`` is imported on first use only.
(MLflow 3 sends usage telemetry unless ``MLFLOW_DISABLE_TELEMETRY=true`` or
``DO_NOT_TRACK=true``.)

A sweep's trial (its spec's ``trial``) is an MLflow child run: its run carries the tag
``mlflow.parentRunId`` of one parent run for the sweep (run name ``sweep <name>``, tags
``ddppipe.sweep`` and ``ddppipe.role: sweep``), which the first trial to create its run creates
and every other finds by those tags, under a file lock in the sweep's folder
(:class:`SweepParent`) so that trials starting at once agree on one parent.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import queue
import re
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddppipe.core import atomic, errors
from ddppipe.runstate.state import StateDir
from ddppipe.settings import layout
from ddppipe.settings.run_spec import RunSpec

log = logging.getLogger(__name__)

DEFAULT_EXPERIMENT = "ddppipe"
# Tracker.close() waits this long for MLflow to take the points still queued.
MLFLOW_CLOSE_TIMEOUT_S = 30.0
# Points waiting for MLflow beyond this are dropped (a server far slower than training).
MLFLOW_QUEUE_MAX = 100_000
_BAD_NAME_CHARS = re.compile(r"[^/\w.\- :]")
# MLflow's limits (mlflow.utils.validation, MLflow 3).
_MAX_KEY_LENGTH = 250
_MAX_PARAM = 6000
_MAX_TAG = 8000
_METRICS_PER_BATCH = 1000
_PARAMS_TAGS_PER_BATCH = 100
PARENT_TAG = "mlflow.parentRunId"  # MLflow's own: the UI nests the run under that run
SWEEP_TAG = "ddppipe.sweep"  # the sweep's name, on its parent run and on every trial's run
ROLE_TAG = "ddppipe.role"  # "sweep" on a sweep's parent run


@dataclass(frozen=True)
class SweepParent:
    """The sweep a trial's MLflow run is a child of, and the lock trials find its parent
    run under."""

    sweep: str
    lock: Path

    @classmethod
    def of(cls, spec: RunSpec, state: StateDir) -> SweepParent | None:
        """The parent of the run ``spec`` whose state folder is ``state``; None: not a
        trial."""
        if spec.trial is None:
            return None
        results = layout.RunLayout.of_root(state.root.parent).results
        return cls(spec.trial.sweep, layout.SweepLayout(spec.trial.sweep, results).mlflow_lock)


class MlflowWorker(threading.Thread):
    """Owns the MLflow client: opens (or creates) the run, then sends queued points in batches."""

    def __init__(
        self, uri: str, state: StateDir, run_name: str, params: dict[str, Any],
        tags: dict[str, str], parent: SweepParent | None = None,
    ) -> None:  # fmt: skip
        super().__init__(name="ddppipe-mlflow", daemon=True)
        self.parent = parent
        self.uri = uri
        self.state = state
        self.run_name = run_name
        self.params = params
        self.tags = tags
        self.run_id: str | None = None
        self._queue: queue.Queue[tuple[int, dict[str, float], int] | None] = queue.Queue(
            MLFLOW_QUEUE_MAX
        )
        self._on = True
        self._dropping = False

    def put(self, step: int, points: dict[str, float]) -> None:
        """Queue points for MLflow; never blocks."""
        if not self._on:
            return
        try:
            self._queue.put_nowait((step, points, int(time.time() * 1000)))
        except queue.Full:
            if not self._dropping:
                self._dropping = True
                log.warning("MLflow is too slow for this run: dropping points")

    def finish(self, timeout: float) -> None:
        """Send what is queued, mark the run finished and stop (at most ``timeout`` s)."""
        if self._on:
            with contextlib.suppress(queue.Full):
                self._queue.put(None, timeout=timeout)
        self.join(timeout)
        if self.is_alive() and self._on:
            self._on = False
            log.warning("MLflow did not take the last points within %.0f s: dropped", timeout)

    def run(self) -> None:
        try:
            self._serve()
        except Exception as e:
            self._on = False
            log.warning(
                "MLflow tracking (%s) off for this process: %s", self.uri, errors.one_line(e)
            )
            _drain(self._queue)

    def _serve(self) -> None:
        from mlflow.entities import Metric, RunTag
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=self.uri)
        run_id = self._open_run(client)
        tags = [RunTag(_key(k), _truncate(str(v), _MAX_TAG)) for k, v in self.tags.items()]
        for i in range(0, len(tags), _PARAMS_TAGS_PER_BATCH):
            client.log_batch(run_id, tags=tags[i : i + _PARAMS_TAGS_PER_BATCH], synchronous=True)
        done = False
        while not done:
            items = [self._queue.get()]
            while len(items) < _METRICS_PER_BATCH:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            metrics = []
            for item in items:
                if item is None:
                    done = True
                    continue
                step, points, ms = item
                metrics += [Metric(_key(k), v, ms, step) for k, v in points.items()]
            for i in range(0, len(metrics), _METRICS_PER_BATCH):
                batch = metrics[i : i + _METRICS_PER_BATCH]
                client.log_batch(run_id, metrics=batch, synchronous=True)
        client.set_terminated(run_id, "FINISHED")

    def _open_run(self, client: Any) -> str:
        """The run of earlier slots (set RUNNING again), or a new one with its params."""
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException

        id_file = self.state.mlflow_run_id
        if id_file.exists():
            run_id = id_file.read_text().strip()
            try:
                run = client.get_run(run_id)
            except MlflowException as e:
                if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise
                run = None
            if run is not None and run.info.lifecycle_stage != "deleted":
                client.update_run(run_id, status="RUNNING")
                self.run_id = run_id
                return run_id
            log.warning(
                "MLflow run %s (%s) is not on %s: starting a new run", run_id, id_file, self.uri
            )
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT
        found = client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else client.create_experiment(experiment)
        nested = {}
        if self.parent is not None:
            nested = {PARENT_TAG: self._parent_run(client, experiment_id),
                      SWEEP_TAG: self.parent.sweep}  # fmt: skip
        run_id = client.create_run(experiment_id, run_name=self.run_name, tags=nested).info.run_id
        params = [Param(_key(k), _truncate(v, _MAX_PARAM)) for k, v in flatten(self.params).items()]
        for i in range(0, len(params), _PARAMS_TAGS_PER_BATCH):
            batch = params[i : i + _PARAMS_TAGS_PER_BATCH]
            client.log_batch(run_id, params=batch, synchronous=True)
        atomic.write_text(id_file, run_id + "\n")
        self.run_id = run_id
        return run_id

    def _parent_run(self, client: Any, experiment_id: str) -> str:
        """The id of the sweep's parent run, found by its tags or created (then finished:
        it holds no points of its own), under the sweep's lock."""
        assert self.parent is not None
        sweep = self.parent.sweep
        with _locked(self.parent.lock):
            found = client.search_runs(
                [experiment_id], max_results=1,
                filter_string=f"tags.`{SWEEP_TAG}` = '{sweep}' and tags.`{ROLE_TAG}` = 'sweep'",
            )  # fmt: skip
            if found:
                return str(found[0].info.run_id)
            run = client.create_run(experiment_id, run_name=f"sweep {sweep}",
                                    tags={SWEEP_TAG: sweep, ROLE_TAG: "sweep"})  # fmt: skip
            client.set_terminated(run.info.run_id, "FINISHED")
            return str(run.info.run_id)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold ``path``'s flock (blocking) for the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def flatten(params: Mapping[str, Any], parent: str = "") -> dict[str, str]:
    """Nested dicts as dotted keys, values as strings: {'a': {'b': 1}} -> {'a.b': '1'}."""
    flat: dict[str, str] = {}
    for key, value in params.items():
        name = f"{parent}.{key}" if parent else str(key)
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, name))
        else:
            flat[name] = str(value)
    return flat


def _key(name: str) -> str:
    """``name`` as a valid MLflow key (characters it refuses become '_')."""
    return _BAD_NAME_CHARS.sub("_", name).lstrip("/")[:_MAX_KEY_LENGTH]


def _truncate(value: str, limit: int) -> str:
    return value if len(value) <= limit else value[:limit]


def _drain(q: queue.Queue[Any]) -> None:
    while True:
        try:
            q.get_nowait()
        except queue.Empty:
            return
