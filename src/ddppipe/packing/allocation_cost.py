"""What a packed sweep's allocations cost: their SLURM jobs, the hours they held, how much of
that the trials used, and how long each waited in the queue (from the pool's records)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from ddppipe.core import atomic
from ddppipe.packing.pool import Pool


@dataclass(frozen=True)
class Cost:
    jobs: list[str]  # the allocations' SLURM jobs (one sbatch each)
    slots: int  # slots of every node of every allocation
    held_s: float  # node-seconds held: from a node's start to its end
    held_hours: float  # CPU-hours (GPU-hours where they held GPUs)
    unit: str  # "CPU" or "GPU"
    busy_s: float  # slot-seconds a trial ran
    span_s: float  # slot-seconds from a node's start to its slot's last trial's end
    queue_s: list[float]  # each allocation's wait, submission to its first node's start

    @property
    def idle_while_trials(self) -> float:
        """The share of the slots' time, up to each one's last trial, that no trial ran."""
        return 1.0 - self.busy_s / self.span_s if self.span_s else 0.0


def cost(pool_root: Path) -> Cost | None:
    """The pool's allocations' cost; None when it submitted none."""
    pool = Pool(pool_root)
    submitted = {r["job"]: r for r in pool.records(pool.allocations) if "job" in r}
    if not submitted:
        return None
    nodes = pool.records(pool.allocations / "nodes")
    held = busy = span = held_units = 0.0
    slots = gpus = 0
    for n in nodes:
        end = n.get("ended") or max([s["last_end"] or 0 for s in n.get("slot_records", [])]
                                    + [n["started"]])  # fmt: skip
        held += end - n["started"]
        slots += n["slots"]
        gpus += n.get("gpus", 0)
        held_units += (end - n["started"]) * (n.get("gpus") or n.get("cpus", 1))
        for s in n.get("slot_records", []):
            busy += s["busy_s"]
            if s["last_end"]:
                span += s["last_end"] - n["started"]
    first = {}
    for n in nodes:
        first[n["job"]] = min(first.get(n["job"], n["started"]), n["started"])
    waits = [first[j] - float(r["submitted"]) for j, r in submitted.items() if j in first]
    return Cost(sorted(submitted, key=int), slots, held, held_units / 3600,
                "GPU" if gpus else "CPU", busy, span, waits)  # fmt: skip


def line(pool_root: Path) -> str | None:
    """The sweep summary's line on its allocations; None for a sweep that packed nothing."""
    found = cost(pool_root)
    if found is None:
        return None
    wait = f", queue wait {max(found.queue_s):.0f} s at most" if found.queue_s else ""
    return (
        f"allocations: {len(found.jobs)} (SLURM job{'s' if len(found.jobs) > 1 else ''} "
        f"{', '.join(found.jobs)}), {found.slots} slot(s); held {found.held_hours:.4f} "
        f"{found.unit}-hours, idle {found.idle_while_trials:.0%} of the slots' time while "
        f"trials remained{wait}"
    )


def write(pool_root: Path) -> str | None:
    """The allocations' cost written to the pool's ``cost.json`` (atomically); its line, None
    for a sweep that packed nothing."""
    found = cost(pool_root)
    if found is None:
        return None
    figures = {**asdict(found), "idle_while_trials": found.idle_while_trials}
    atomic.write_json(Pool(pool_root).cost, figures)
    return line(pool_root)
