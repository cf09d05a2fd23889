"""A run's summary in a few lines: what it trained, how well, how fast, how its slots ended.

Printed at the end of every ``snakemake`` call (onsuccess/onerror) and by ``ddppipe summary``;
read from the run's files (config, metrics, attempt history), so it costs no torch and works
while a run is still training (from its state folder) as after it. For a SLURM run it is also
the one place that asks SLURM's accounting (``sacct``, :mod:`ddppipe.cluster.accounting`), on the
submitting machine, and sets its figures beside the run's own.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ddppipe.cluster import accounting
from ddppipe.core import jsonl
from ddppipe.runstate import state
from ddppipe.spec import layout


@dataclass
class Summary:
    run: str
    what: str  # the task (or script) and its file's SHA-256
    lines: list[tuple[str, str]] = field(default_factory=list)

    def text(self) -> str:
        width = max((len(k) for k, _ in self.lines), default=0)
        body = "\n".join(f"  {k.ljust(width)}  {v}" for k, v in self.lines)
        return f"run {self.run}: {self.what}\n{body}"


def _first(*paths: Path) -> Path | None:
    return next((p for p in paths if p.exists()), None)


def _percent(x: float) -> str:
    return f"{100 * x:.2f} %"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def _source(cfg: dict[str, Any]) -> str:
    source = cfg.get("task_source") or {}
    run_kind = layout.kind(cfg)
    ref = cfg["script"] if run_kind == "script" else cfg.get("task", "ddppipe.tasks.mnist")
    digest = f" (sha256 {source['sha256'][:12]})" if source.get("sha256") else ""
    return f"{run_kind} {ref}{digest}"


def _targets(
    history: list[dict[str, Any]], targets: list[float], origin: tuple[float, str] | None
) -> str:
    parts = []
    for target in targets:
        reached = next((m for m in history if m.get("test_accuracy", 0) >= target), None)
        if reached is None:
            parts.append(f"{_percent(target)}: not reached")
            continue
        parts.append(f"{_percent(target)}: epoch {reached['epoch']}")
        if origin:
            parts[-1] += f", {_duration(reached['time'] - origin[0])} after the {origin[1]}"
    return "; ".join(parts)


def _origin(
    attempts: list[dict[str, Any]], records: list[accounting.Record] | None
) -> tuple[float, str] | None:
    """(Unix time, name) the run's times count from: its first SLURM submission (sacct's
    Submit, else scontrol's, which the first slot recorded), else its first slot's start."""
    submits = [r.submit for r in records or [] if r.submit is not None]
    if attempts and attempts[0].get("submitted") is not None:
        submits.append(attempts[0]["submitted"])
    if submits:
        return min(submits), "first submission"
    return (attempts[0]["start"], "first slot's start") if attempts else None


def _sacct(
    attempts: list[dict[str, Any]], records: list[accounting.Record] | None
) -> tuple[str, str]:
    """SLURM's accounting of the run's jobs beside the ranks' own figures, where both exist."""
    if not records:
        return "sacct", "no SLURM accounting: own measurements"
    jobs = len({r.job for r in records})
    requeues = len(records) - jobs
    states = ", ".join(f"{n} {state}" for state, n in Counter(r.state for r in records).items())
    parts = [f"{len(records)} job record(s) ({jobs} job(s), {requeues} requeue(s)): {states}"]
    own = [a["efficiency"] for a in attempts if a.get("efficiency")]
    held = [r.cpu_hours for r in records if r.cpu_hours is not None]
    if held:
        parts.append(f"{sum(held):,.3f} CPU-hours allocated")
    cpu = [r.total_cpu_s for r in records if r.total_cpu_s is not None]
    if cpu:
        mine = f" (the ranks' own {_duration(sum(e.get('cpu_s', 0.0) for e in own))})"
        parts.append(f"TotalCPU {_duration(sum(cpu))}" + (mine if own else ""))
    rss = [r.max_rss_mb for r in records if r.max_rss_mb is not None]
    if rss:
        memory = f"MaxRSS {max(rss):,.0f} MB a task"
        asked = [r.req_mem_mb / r.nodes for r in records if r.req_mem_mb and r.nodes]
        if asked:
            memory += f" of ReqMem {max(asked):,.0f} MB a node"
        if own:
            memory += f" (own peak {max(e.get('memory_peak_mb', 0.0) for e in own):,.0f} MB a node)"
        parts.append(memory)
    queued = [r.queue_s for r in records if r.queue_s is not None]
    if queued:
        mine = [a["queue_s"] for a in attempts if a.get("queue_s") is not None]
        own_queue = f" (own {_duration(sum(mine))})" if mine else ""
        parts.append(f"queued {_duration(sum(queued))}{own_queue}")
    return "sacct", "; ".join(parts)


def _attempts(history: list[dict[str, Any]]) -> str:
    counts = Counter(a["outcome"] for a in history)
    ended = ", ".join(f"{n} {outcome}" for outcome, n in counts.items())
    return f"{len(history)} slot(s): {ended}"


def _allocation(cfg: dict[str, Any], local: bool) -> tuple[int | None, int | None, int]:
    """(memory MB per node, time limit min, CPUs) the run's slots had; None: no such limit."""
    from ddppipe.cluster import slurm
    from ddppipe.core import system
    from ddppipe.spec.run import RunSpec

    try:
        request = slurm.Request.from_spec(RunSpec.from_config(cfg))
    except Exception:  # an unresolved or foreign config: no allocation to compare with
        return None, None, 0
    if local:
        return None, None, request.node_threads(system.available_cpus())
    return request.mem_mb, request.runtime, request.cpus_per_node * request.nodes


def _efficiency(cfg: dict[str, Any], attempts: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """Where the slots' time went, throughput and utilisation, and the waste flags."""
    from ddppipe.training import efficiency

    measured = [a for a in attempts if a.get("efficiency")]
    if not measured:
        return []
    mem_mb, runtime, cpus = _allocation(cfg, measured[-1]["job"] == "local")
    total = {k: sum(a["efficiency"].get(k, 0.0) for a in measured)
             for k in ("startup_s", "data_s", "train_s", "evaluate_s", "checkpoint_s")}  # fmt: skip
    wall = sum((a.get("end") or time.time()) - a["start"] for a in measured)
    parts = ", ".join(f"{name} {_duration(total[key])}" for name, key in (
        ("start-up", "startup_s"), ("training", "train_s"), ("evaluation", "evaluate_s"),
        ("checkpoints", "checkpoint_s"),
    ))  # fmt: skip
    lines = [("time", f"{_duration(wall)} in {len(measured)} slot(s): {parts}")]
    last = measured[-1]["efficiency"]
    if "images_per_s" in last:
        speed = f"{last['images_per_s']:,.0f} images/s steady in the last slot"
        if "warmup_images_per_s" in last:
            speed += f" ({last['warmup_images_per_s']:,.0f} in its first steps)"
        if "achieved_gflops" in last:
            speed += (f"; {last['flops_per_image'] / 1e6:,.1f} MFLOP an image, "
                      f"{last['achieved_gflops']:,.1f} GFLOP/s")  # fmt: skip
        lines.append(("throughput", speed))
        lines.append(("utilisation", _utilisation(cfg, measured[-1])))
    if "communication_share" in last:
        lines.append(("communication", (
            f"{last['communication_share']:.0%} of a step waits for the all-reduce "
            f"({last['communication_s'] * 1e3:,.1f} ms not hidden behind the backward)"
        )))  # fmt: skip
    cpu_s = sum(a["efficiency"].get("cpu_s", 0.0) for a in measured)
    use = efficiency.cpu_efficiency(cpu_s, wall, cpus)
    peak = max(a["efficiency"].get("memory_peak_mb", 0.0) for a in measured)
    usage = f"memory peak {peak:,.0f} MB a node" + (f" of {mem_mb:,} MB" if mem_mb else "")
    if use is not None:
        usage = f"CPU {use:.0%} of {cpus} busy; " + usage
    if "gpu_utilisation" in last:
        usage = (f"GPU {last['gpu_utilisation']:.0%} busy (NVML), memory peak "
                 f"{last['gpu_memory_peak_mb']:,.0f} of {last['gpu_memory_total_mb']:,.0f} MB "
                 f"({last['gpu_name']}); ") + usage  # fmt: skip
    lines.append(("usage", usage))
    queued = sum(a.get("queue_s") or 0.0 for a in measured)
    gpus = _gpus(cfg)
    unit, units = ("GPU", gpus) if gpus else ("CPU", cpus)
    hours = units * wall / 3600
    training = units * total["train_s"] / 3600
    redone = sum(max(0, a["efficiency"].get("steps", 0) - _checkpointed(a)) for a in measured[:-1])
    held = f"{_duration(queued)} queued"
    if hours:
        held = (
            f"{hours:,.2f} {unit}-hours held ({units} {unit}s), {training:,.2f} of them "
            f"training ({training / hours:.0%}); {held}; {redone} steps redone after resumes"
        )
    lines.append(("allocation", held))
    for attempt in measured[-1:]:
        lines.extend(("waste", flag) for flag in efficiency.flags(attempt, mem_mb, runtime, cpus))
    return lines


def _utilisation(cfg: dict[str, Any], attempt: dict[str, Any]) -> str:
    """The last slot's achieved FLOP/s against its allocation's peak, and the peak's source."""
    from ddppipe.spec import config
    from ddppipe.training import efficiency

    precision = (cfg.get("train") or {}).get("precision", "fp32")
    processes = config.world_size(cfg) if cfg.get("launch") else 1
    found = efficiency.utilisation(attempt, precision, processes)
    if found is None:
        return "no peak to compare with: the preflight measures it (SLURM runs), or a known GPU"
    fraction, source = found
    return f"{fraction:.0%} of the peak ({source})"


def _gpus(cfg: dict[str, Any]) -> int:
    """GPUs the run's slots held (one per process with ``launch.device: gpu``)."""
    from ddppipe.spec import config

    return config.world_size(cfg) if cfg.get("launch") and config.gpus_requested(cfg) else 0


def _checkpointed(attempt: dict[str, Any]) -> int:
    start, end = attempt.get("start_step"), attempt.get("end_step")
    return end - start if start is not None and end is not None else 0


def build(run_dir: Path) -> Summary:
    """The summary of the run in ``run_dir`` (``results/<run>``)."""
    run = layout.RunLayout.of_root(run_dir)
    live = state.of(run.state)  # while it trains; train/ once it completed
    cfg = yaml.safe_load(run.config.read_text()) if run.config.exists() else {}
    summary = Summary(run.run, _source(cfg) if cfg else "not configured yet")
    metrics_path = _first(run.train.metrics, live.metrics)
    history = jsonl.read(metrics_path) if metrics_path else []
    attempts_path = _first(run.train.attempts, live.attempts)
    attempts = json.loads(attempts_path.read_text()) if attempts_path else []
    jobs = [a["job"] for a in attempts if a.get("job", "local") != "local"]
    records = accounting.query(jobs) if jobs else None
    origin = _origin(attempts, records)
    if layout.kind(cfg) == "script":
        if history:
            last = {k: v for r in history for k, v in r.items() if k != "time"}
            summary.lines.append(("logged", ", ".join(f"{k} {v:.4g}" for k, v in last.items()
                                                       if isinstance(v, int | float))))  # fmt: skip
    elif history:
        final = history[-1]
        if "test_accuracy" in final:
            best = max(history, key=lambda m: m["test_accuracy"])
            summary.lines.append((
                "accuracy",
                f"{_percent(final['test_accuracy'])} after epoch {final['epoch']} "
                f"(best {_percent(best['test_accuracy'])}, epoch {best['epoch']}); "
                f"test loss {final['test_loss']:.4f}",
            ))  # fmt: skip
            targets = (cfg.get("scaling") or {}).get("accuracy_targets") or [0.98, 0.99]
            summary.lines.append(("targets", _targets(history, targets, origin)))
        else:
            tested = {k: v for k, v in final.items() if k.startswith("test_")}
            summary.lines.append(("test", ", ".join(f"{k} {v:.4g}" for k, v in tested.items())))
        speed = statistics.median(m["images_per_s"] for m in history)
        summary.lines.append((
            "speed",
            f"{speed:,.0f} images/s (median of {len(history)} epoch(s), "
            f"{final.get('world_size', '?')} processes)",
        ))  # fmt: skip
    else:
        summary.lines.append(("training", "no epoch finished yet"))
    if attempts:
        summary.lines.append(("attempts", _attempts(attempts)))
        summary.lines.extend(_efficiency(cfg, attempts))
        if jobs:
            summary.lines.append(_sacct(attempts, records))
        end = attempts[-1].get("end") or time.time()
        if origin is not None:
            summary.lines.append(("wall", f"{_duration(end - origin[0])} from the {origin[1]} "
                                           "to the last slot's end"))  # fmt: skip
    export = run.export
    outputs = [p for p in (export.weights, export.outputs, export.provenance) if p.exists()]
    if outputs:
        summary.lines.append(("results", ", ".join(str(p) for p in outputs)))
    return summary


def text(run_dir: Path) -> str:
    return build(run_dir).text()
