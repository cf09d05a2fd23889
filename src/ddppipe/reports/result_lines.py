"""The summary's lines on what the run trained and how well: its task or script, accuracy and
the epochs that reached its targets (or a script's last logged values), and its speed.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from ddppipe.reports.run_files import About
from ddppipe.reports.wording import duration, percent
from ddppipe.training.loop.pruning import PRUNED_AT

Line = tuple[str, str]


def what(about: About) -> str:
    """The run's heading: the task or script and its file's SHA-256."""
    if not about.configured:
        return "not configured yet"
    digest = f" (sha256 {about.sha256[:12]})" if about.sha256 else ""
    return f"{about.kind} {about.trains}{digest}"


def first_reaching(history: list[dict[str, Any]], target: float) -> dict[str, Any] | None:
    """The first epoch's record whose test accuracy reached ``target``; None: not reached."""
    return next((m for m in history if m.get("test_accuracy", 0) >= target), None)


def images_per_s(history: list[dict[str, Any]]) -> float:
    """The run's speed: the median of its epochs' training images/s (all ranks together)."""
    return statistics.median(m["images_per_s"] for m in history)


def targets(
    history: list[dict[str, Any]], wanted: tuple[float, ...], origin: tuple[float, str] | None
) -> str:
    """The first epoch that reached each target accuracy, and when after ``origin``."""
    parts = []
    for target in wanted:
        reached = first_reaching(history, target)
        if reached is None:
            parts.append(f"{percent(target)}: not reached")
            continue
        parts.append(f"{percent(target)}: epoch {reached['epoch']}")
        if origin:
            parts[-1] += f", {duration(reached['time'] - origin[0])} after the {origin[1]}"
    return "; ".join(parts)


def pruned(about: About, evaluation: dict[str, Any]) -> list[Line]:
    """A sweep's trial that pruned itself: the epoch it stopped at, and by which rule."""
    epoch = evaluation.get(PRUNED_AT)
    if epoch is None:
        return []
    trial = about.spec.trial if about.spec is not None else None
    rule = ""
    if trial is not None and trial.prune is not None:
        rule = f" ({trial.prune.method} rule of sweep {trial.sweep} on {trial.prune.metric})"
    return [("outcome", f"pruned at epoch {epoch}{rule}")]


def nonfinite(history: list[dict[str, Any]]) -> list[Line]:
    """A warning when a script logged a NaN or infinite value: which, from which step."""
    for record in history:
        bad = [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)]
        if bad:
            return [("warning", f"non-finite {', '.join(bad)} logged from step "
                                f"{record.get('step', '?')} on (job.log)")]  # fmt: skip
    return []


def lines(
    about: About, history: list[dict[str, Any]], origin: tuple[float, str] | None
) -> list[Line]:
    """What the metrics ``history`` say: a script's last logged values; a task's accuracy (or
    test figures), its targets and its speed; or that no epoch finished yet."""
    if about.kind == "script":
        if not history:
            return []
        last = {k: v for r in history for k, v in r.items() if k != "time"}
        return [("logged", ", ".join(f"{k} {v:.4g}" for k, v in last.items()
                                     if isinstance(v, int | float))),
                *nonfinite(history)]  # fmt: skip
    if not history:
        return [("training", "no epoch finished yet")]
    final = history[-1]
    found: list[Line] = []
    if "test_accuracy" in final:
        best = max(history, key=lambda m: m["test_accuracy"])
        found.append((
            "accuracy",
            f"{percent(final['test_accuracy'])} after epoch {final['epoch']} "
            f"(best {percent(best['test_accuracy'])}, epoch {best['epoch']}); "
            f"test loss {final['test_loss']:.4f}",
        ))  # fmt: skip
        found.append(("targets", targets(history, about.accuracy_targets, origin)))
    else:
        tested = {k: v for k, v in final.items() if k.startswith("test_")}
        found.append(("test", ", ".join(f"{k} {v:.4g}" for k, v in tested.items())))
    speed = images_per_s(history)
    found.append((
        "speed",
        f"{speed:,.0f} images/s (median of {len(history)} epoch(s), "
        f"{final.get('world_size', '?')} processes)",
    ))  # fmt: skip
    return found
