"""A sweep in TensorBoard's HParams view: ``tensorboard --logdir results/sweeps/<name>``.

Written with TensorBoard's own protos and record format (no torch, no TensorFlow): the
experiment (each swept key, the trial's outcome, and the metrics the view shows) in an event
file at the sweep's root, and one session a trial in an event file at the trial's root, so the
view names each session after its trial (``lr=0.01``) and TensorBoard's scalars list its
training curves beside it (``lr=0.01/tensorboard``). A session holds the trial's values, its
status (completed and pruned: success; failed: failure; running) and its final figures as
scalars at its last epoch: the metric, its best, epochs, images/s, hours held and training,
goodput.

Each file is rewritten only when what it holds changed (its name ends with a digest of it),
atomically, and replaces the earlier one: the table is written after every snakemake call.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ddppipe.core import atomic
from ddppipe.sweeps.trials import COMPLETED, FAILED, PRUNED, RUNNING, Table, TrialResult

OUTCOME = "outcome"  # an hparam of every session: filter the view by how a trial ended
GROUP = "sweep"  # the tags of a session's figures: sweep/<metric>, sweep/hours_held, ...
SUFFIX = ".ddppipe-hparams-"  # in the event files' names, before the digest of their content


def figures(table: Table, trial: TrialResult) -> dict[str, float]:
    """A trial's final figures, by the tag TensorBoard shows them under (None left out)."""
    m, cost = table.metric, trial.cost
    found = {
        m: trial.final, f"best_{m}": trial.best, "epochs": float(trial.epochs),
        "images_per_s": trial.images_per_s, "hours_held": cost.held_h if cost else None,
        "hours_training": cost.training_h if cost else None,
        "goodput": cost.goodput if cost else None,
    }  # fmt: skip
    return {f"{GROUP}/{k}": float(v) for k, v in found.items() if v is not None}


def _value(value: Any) -> bool | float | str:
    """A value as the view takes it: a bool, number or text (anything else as JSON)."""
    if isinstance(value, bool | str):
        return value
    if isinstance(value, int | float):
        return float(value)
    return json.dumps(value, sort_keys=True)


def _domain(values: list[bool | float | str]) -> Any:
    """The values of one key as a discrete domain (the view's filter); None where they mix
    types."""
    from tensorboard.plugins.hparams import summary_v2

    kinds = {type(v) for v in values}
    return summary_v2.Discrete(sorted(set(values))) if len(kinds) == 1 else None


def _status(outcome: str) -> int:
    from tensorboard.plugins.hparams import api_pb2

    return {COMPLETED: api_pb2.STATUS_SUCCESS, PRUNED: api_pb2.STATUS_SUCCESS,
            FAILED: api_pb2.STATUS_FAILURE, RUNNING: api_pb2.STATUS_RUNNING,
            }.get(outcome, api_pb2.STATUS_UNKNOWN)  # fmt: skip


def _summary(tag: str, data: Any) -> Any:
    """A Summary holding the hparams plugin's ``data`` under ``tag``."""
    from tensorboard.compat.proto import summary_pb2
    from tensorboard.plugins.hparams import metadata

    summary = summary_pb2.Summary()
    summary.value.add(tag=tag, metadata=metadata.create_summary_metadata(data),
                      tensor=metadata.NULL_TENSOR)  # fmt: skip
    return summary


def _events(summaries: list[tuple[int, Any]], wall_time: float) -> bytes:
    """The event file's bytes: its version record, then each (step, Summary)."""
    import io

    from tensorboard.compat.proto import event_pb2
    from tensorboard.summary.writer.record_writer import RecordWriter

    buffer = io.BytesIO()
    writer = RecordWriter(buffer)
    writer.write(event_pb2.Event(wall_time=wall_time, file_version="brain.Event:2")
                 .SerializeToString())  # fmt: skip
    for step, summary in summaries:
        event = event_pb2.Event(wall_time=wall_time, step=step, summary=summary)
        writer.write(event.SerializeToString())
    return buffer.getvalue()


def _write(folder: Path, content: Mapping[str, Any], summaries: list[tuple[int, Any]]) -> bool:
    """Write ``summaries`` into ``folder``'s hparams event file unless it holds ``content``
    already; the earlier file is removed. Whether it wrote."""
    digest = hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:12]
    earlier = list(folder.glob(f"events.out.tfevents.*{SUFFIX}*")) if folder.is_dir() else []
    if any(p.name.endswith(SUFFIX + digest) for p in earlier):
        return False
    now = time.time()
    name = f"events.out.tfevents.{int(now)}{SUFFIX}{digest}"  # derived: no fsync needed
    atomic.write_bytes(folder / name, _events(summaries, now), durable=False)
    for path in earlier:
        path.unlink(missing_ok=True)
    return True


def _session(table: Table, trial: TrialResult) -> tuple[dict[str, Any], list[tuple[int, Any]]]:
    from tensorboard.compat.proto import summary_pb2
    from tensorboard.plugins.hparams import metadata, plugin_data_pb2, summary_v2

    values = {k: _value(v) for k, v in trial.values.items()}
    values[OUTCOME] = trial.outcome
    found = figures(table, trial)
    content = {"values": values, "figures": found, "status": trial.outcome}
    start = summary_v2.hparams_pb(values, trial_id=trial.name, start_time_secs=0.0)
    scalars = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=k, simple_value=v)
                                         for k, v in found.items()])  # fmt: skip
    ended = plugin_data_pb2.SessionEndInfo(status=_status(trial.outcome))
    end = _summary(metadata.SESSION_END_INFO_TAG,
                   plugin_data_pb2.HParamsPluginData(session_end_info=ended))  # fmt: skip
    return content, [(0, start), (trial.epochs, scalars), (trial.epochs, end)]


def _experiment(table: Table) -> tuple[dict[str, Any], list[tuple[int, Any]]]:
    from tensorboard.plugins.hparams import summary_v2

    m = table.metric
    hparams = [summary_v2.HParam(k, _domain([_value(t.values[k]) for t in table.trials]))
               for k in table.keys]  # fmt: skip
    hparams.append(summary_v2.HParam(OUTCOME, summary_v2.Discrete([COMPLETED, PRUNED, FAILED,
                                                                   RUNNING])))  # fmt: skip
    shown = {m: f"{m} (final)", f"best_{m}": f"best {m}", "epochs": "epochs",
             "images_per_s": "images/s", "hours_held": "hours held",
             "hours_training": "hours training", "goodput": "goodput"}  # fmt: skip
    metrics = [
        summary_v2.Metric(f"{GROUP}/{tag}", display_name=name) for tag, name in shown.items()
    ]
    content = {"keys": [*table.keys, OUTCOME], "metrics": shown}
    return content, [(0, summary_v2.hparams_config_pb(hparams, metrics, time_created_secs=0.0))]


def write(table: Table) -> int:
    """The sweep's experiment and every trial that ran as a session; the files written."""
    written = int(_write(table.layout.root, *_experiment(table)))
    for trial in table.trials:
        if trial.outcome != "pending":
            written += _write(trial.layout.root, *_session(table, trial))
    return written
