"""The summary's lines on the run's slots: how they ended, where their time went, throughput,
utilisation, what they used of their allocation (and each rank of its memory), what the last
slot's checkpoints cost, the hours they held, their goodput (:mod:`~ddppipe.reports.goodput`)
and the waste flags.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

from ddppipe.reports import goodput, memory_line, utilisation, waste
from ddppipe.reports.hours import Allocation, Slots, hours, measured
from ddppipe.reports.wording import duration
from ddppipe.runstate import outcomes, startup
from ddppipe.runstate.outcomes import Kind
from ddppipe.settings.run_spec import RunSpec

Line = tuple[str, str]


def endings(attempts: list[dict[str, Any]]) -> Line:
    """How many slots trained the run and how each ended."""
    counts = Counter(a["outcome"] for a in attempts)
    ended = ", ".join(f"{n} {outcome}" for outcome, n in counts.items())
    return "attempts", f"{len(attempts)} slot(s): {ended}"


def failure(attempts: list[dict[str, Any]]) -> list[Line]:
    """Why the last slot failed, when a rank's failure ended it (ddppipe.runstate.failures):
    the first failing rank, its exception and the user's line, or the non-finite loss."""
    last = attempts[-1]
    return [("failed", last["detail"])] if last.get("failure") and last.get("detail") else []


def hangs(attempts: list[dict[str, Any]], most: int = 3) -> list[Line]:
    """The last ``most`` slots that hung (ddppipe.launching.watchdog): the ranks that did not
    progress and their frames; and a completed last slot's note (a script the watchdog could
    not watch)."""
    lines = [("hung", f"slot {a['number']}: {a['detail']}")
             for a in attempts if outcomes.kind_of(a) is Kind.HUNG][-most:]  # fmt: skip
    last = attempts[-1]
    if outcomes.kind_of(last) is Kind.COMPLETED and last.get("detail"):
        lines.append(("note", last["detail"]))
    return lines


def efficiency(spec: RunSpec | None, attempts: list[dict[str, Any]]) -> list[Line]:
    """Where the slots' time went, throughput and utilisation, and the waste flags (nothing
    before a slot recorded its figures); ``spec``: the run's, None for a config without one."""
    slots = measured(attempts)
    if not slots:
        return []
    held = Allocation.of(spec, slots[-1]["job"] == "local")
    if slots[-1].get("mem_mb"):  # what the last slot's job asked for (its request may differ)
        held = dataclasses.replace(held, mem_mb=slots[-1]["mem_mb"])
    total = Slots.of(slots)
    last = slots[-1]["efficiency"]
    memory = memory_line.line(last)  # the last slot's peak per rank
    lines = [_time(total), *start_up(attempts), *_speed(last, slots[-1], held),
             ("usage", _usage(total, last, held)), *([memory] if memory else []),
             *_checkpoints(last), ("allocation", _allocation(total, held))]  # fmt: skip
    run = goodput.account(attempts)
    if run is not None:
        lines.append(("goodput", goodput.line(run)))
    sized = spec is not None and spec.slurm.mem_mb is None  # the next job sizes itself
    flags = waste.flags(slots[-1], held.mem_mb, held.runtime_min, held.cpus, sized)
    return lines + [("waste", flag) for flag in flags]


def _time(total: Slots) -> Line:
    parts = ", ".join(f"{name} {duration(total.phases[key])}" for name, key in (
        ("start-up", "startup_s"), ("training", "train_s"), ("evaluation", "evaluate_s"),
        ("checkpoints", "checkpoint_s"),
    ))  # fmt: skip
    return "time", f"{duration(total.wall_s)} in {total.count} slot(s): {parts}"


def start_up(attempts: list[dict[str, Any]]) -> list[Line]:
    """The last slot's start-up in parts (:mod:`ddppipe.runstate.startup`), where measured:
    when its first step was done after the slot started, and the part each process took."""
    for attempt in reversed(attempts):
        found = startup.of_attempt(attempt)
        if not found:
            continue
        since = "its job" if startup.from_job(found) else "its launcher"
        parts = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in found.items())
        slot = f" (slot {attempt['number']})" if len(attempts) > 1 else ""
        what = "first step done" if startup.FIRST_STEP in found else "ready, no step trained,"
        return [("start-up", f"{what} {sum(found.values()):.1f} s after {since} "
                             f"started{slot}: {parts}")]  # fmt: skip
    return []


def _checkpoints(last: dict[str, Any]) -> list[Line]:
    """What the last slot's checkpoints cost a save (:mod:`ddppipe.training.measuring.save_costs`;
    none for a slot recorded before it counted their copies)."""
    saves = last.get("checkpoints", 0)
    if not saves or "checkpoint_copy_s" not in last:
        return []
    text = (f"{saves} in the last slot ({last['timed_checkpoints']} by time): training blocked "
            f"{_short(last['checkpoint_s'] / saves)} a save (at most "
            f"{_short(last['checkpoint_max_s'])})")  # fmt: skip
    if last["checkpoint_queued"]:
        text += (f", {last['checkpoint_queued']} of them waited "
                 f"{_short(last['checkpoint_queued_s'])} for the previous one's write")  # fmt: skip
    text += (f"; a save's copy {_short(last['checkpoint_copy_s'] / saves)}, its write "
             f"{_short(last['checkpoint_write_s'] / saves)} (in the background)")  # fmt: skip
    return [("checkpoints", text)]


def _short(seconds: float) -> str:
    """Milliseconds below a second, else :func:`duration`."""
    return f"{seconds * 1e3:,.0f} ms" if seconds < 1 else duration(seconds)


def _speed(last: dict[str, Any], attempt: dict[str, Any], held: Allocation) -> list[Line]:
    """The last slot's throughput, its utilisation of the peak and its communication."""
    lines = []
    if "images_per_s" in last:
        speed = f"{last['images_per_s']:,.0f} images/s steady in the last slot"
        if "warmup_images_per_s" in last:
            speed += f" ({last['warmup_images_per_s']:,.0f} in its first steps)"
        if "achieved_gflops" in last:
            speed += (f"; {last['flops_per_image'] / 1e6:,.1f} MFLOP an image, "
                      f"{last['achieved_gflops']:,.1f} GFLOP/s")  # fmt: skip
        lines.append(("throughput", speed))
        lines.append(("utilisation", utilisation.describe(attempt, held.precision,
                                                          held.processes)))  # fmt: skip
    if "data_wait_share" in last:
        lines.append(("data", (
            f"{last['data_wait_share']:.0%} of a step waits for its batch "
            f"({duration(last.get('data_wait_s', 0.0))} in the last slot's steady steps)"
        )))  # fmt: skip
    if "communication_share" in last:
        lines.append(("communication", (
            f"{last['communication_share']:.0%} of a step waits for the all-reduce "
            f"({last['communication_s'] * 1e3:,.1f} ms not hidden behind the backward)"
        )))  # fmt: skip
    return lines


def _usage(total: Slots, last: dict[str, Any], held: Allocation) -> str:
    """What the slots used of their CPUs and memory, and the last slot of its GPUs."""
    usage = f"memory peak {total.memory_peak_mb:,.0f} MB a node" + (
        f" of {held.mem_mb:,} MB" if held.mem_mb else ""
    )
    busy = waste.cpu_efficiency(total.cpu_s, total.wall_s, held.cpus)
    if busy is not None:
        usage = f"CPU {busy:.0%} of {held.cpus} busy; " + usage
    if "gpu_utilisation" in last:
        usage = (f"GPU {last['gpu_utilisation']:.0%} busy (NVML), memory peak "
                 f"{last['gpu_memory_peak_mb']:,.0f} of {last['gpu_memory_total_mb']:,.0f} MB "
                 f"({last['gpu_name']}); ") + usage  # fmt: skip
    return usage


def _allocation(total: Slots, held: Allocation) -> str:
    """The GPU- (else CPU-) hours the slots held, and how many of them trained."""
    queued = f"{duration(total.queue_s)} queued"
    unit, units = held.unit
    all_hours = hours(units, total.wall_s)
    if not all_hours:
        return queued
    training = hours(units, total.phases["train_s"])
    return (
        f"{all_hours:,.2f} {unit}-hours held ({units} {unit}s), {training:,.2f} of them "
        f"training ({training / all_hours:.0%}); {queued}"
    )


def wall(attempts: list[dict[str, Any]], origin: tuple[float, str], now: float) -> Line:
    """The run's wall time from its origin to its last slot's end (``now`` while it trains)."""
    end = attempts[-1].get("end") or now
    return "wall", f"{duration(end - origin[0])} from the {origin[1]} to the last slot's end"
