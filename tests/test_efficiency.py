"""Waste flags: plain words, the centres' thresholds, and the fix."""

from __future__ import annotations

from ddppipe import efficiency


def attempt(wall: float, **figures: float) -> dict:
    return {"start": 1000.0, "end": 1000.0 + wall, "outcome": "completed",
            "efficiency": {"startup_s": 10.0, **figures}}  # fmt: skip


def test_memory_far_below_the_request_suggests_a_request() -> None:
    found = efficiency.flags(attempt(600, memory_peak_mb=2_100, cpu_s=4_000), 8_000, 30, 8)
    assert found == [
        "memory: the fullest node peaked at 2,100 MB of the 8,000 MB requested (26%); "
        "ask for 2700 MB: `slurm.mem_mb: 2700`"
    ]


def test_a_slot_that_used_little_of_its_time_limit() -> None:
    found = efficiency.flags(attempt(120, memory_peak_mb=7_000, cpu_s=900), 8_000, 60, 8)
    assert found == [
        "time limit: the slot used 3% of its 60 min; a shorter limit starts sooner: "
        "`slurm.runtime: 5`"
    ]


def test_idle_cpus_and_a_long_start_up() -> None:
    idle = efficiency.flags(attempt(600, memory_peak_mb=7_000, cpu_s=600), 8_000, 15, 8)
    assert idle == [
        "CPU: 12% of the 8 CPUs allocated were busy over the slot; fewer CPUs per process "
        "(`launch.cpus_per_proc`) or more processes would use them"
    ]
    slow = efficiency.flags(attempt(15, memory_peak_mb=7_000, cpu_s=10), 8_000, None, 8)
    assert slow == [
        "start-up: 10 s of the slot's 15 s passed before the first step (torchrun, rendezvous, "
        "preflight, data): the fewer and longer the slots, the less of it (`slurm.runtime`, "
        "`train.epochs`)"
    ]


def test_a_well_used_allocation_has_no_flag() -> None:
    assert efficiency.flags(attempt(1_500, memory_peak_mb=7_000, cpu_s=11_000), 8_000, 30, 8) == []


def test_queue_wait_of_a_requeued_slot_counts_from_its_requeue() -> None:
    from ddppipe import continuation

    job = {"SubmitTime": "2026-11-23T10:00:00", "EligibleTime": "2026-11-23T10:02:00",
           "StartTime": "2026-11-23T10:02:45"}  # fmt: skip
    assert continuation.queue_seconds(job) == 45.0
    assert continuation.queue_seconds({"StartTime": "Unknown"}) == 0.0
