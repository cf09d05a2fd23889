"""Waste flags: plain words, the centres' thresholds, and the fix."""

from __future__ import annotations

import resource

from ddppipe.reports import utilisation, waste
from ddppipe.training.measuring import efficiency


def attempt(wall: float, **figures: float) -> dict:
    return {"start": 1000.0, "end": 1000.0 + wall, "outcome": "completed",
            "efficiency": {"startup_s": 10.0, **figures}}  # fmt: skip


def test_memory_far_below_the_request_suggests_a_request() -> None:
    found = waste.flags(attempt(600, memory_peak_mb=2_100, cpu_s=4_000), 8_000, 30, 8)
    assert found == [
        "memory: the fullest node peaked at 2,100 MB of the 8,000 MB requested (26%); "
        "ask for 2700 MB: `slurm.mem_mb: 2700`"
    ]
    sized = waste.flags(attempt(600, memory_peak_mb=2_100, cpu_s=4_000), 8_000, 30, 8, True)
    assert sized == [  # slurm.mem_mb null: nothing to set, the next job asks for less itself
        "memory: the fullest node peaked at 2,100 MB of the 8,000 MB requested (26%); the "
        "run's next job asks for 2700 MB (its peak and a quarter: `slurm.mem_mb` is null)"
    ]


def test_a_peak_within_10_percent_of_the_request_or_above_it_is_flagged() -> None:
    near = waste.flags(attempt(600, memory_peak_mb=1_850, cpu_s=1_100), 2_000, 30, 2)
    assert near == [
        "memory: the fullest node peaked at 1,850 MB, within 10 % of the 2,000 MB requested "
        "(92%): a cluster that enforces the request (cgroup) kills the job there; ask for "
        "2400 MB: `slurm.mem_mb: 2400` (or leave it null: the run's next job asks for its "
        "measured peak and a quarter)"
    ]
    assert waste.flags(attempt(600, memory_peak_mb=1_790, cpu_s=1_100), 2_000, 30, 2) == []
    above = waste.flags(attempt(600, memory_peak_mb=2_053, cpu_s=1_100), 2_000, 30, 2)
    assert [flag[:66] for flag in above] == [
        "memory: the fullest node peaked at 2,053 MB, above the 2,000 MB re"
    ]
    assert waste.flags(attempt(600, memory_peak_mb=2_053, cpu_s=1_100), None, 30, 2) == []


def test_a_slot_that_used_little_of_its_time_limit() -> None:
    found = waste.flags(attempt(120, memory_peak_mb=7_000, cpu_s=900), 8_000, 60, 8)
    assert found == [
        "time limit: the slot used 3% of its 60 min; a shorter limit starts sooner: "
        "`slurm.runtime: 5`"
    ]


def test_idle_cpus_and_a_long_start_up() -> None:
    idle = waste.flags(attempt(600, memory_peak_mb=7_000, cpu_s=600), 8_000, 15, 8)
    assert idle == [
        "CPU: 12% of the 8 CPUs allocated were busy over the slot; fewer CPUs per process "
        "(`launch.cpus_per_proc`) or more processes would use them"
    ]
    slow = waste.flags(attempt(15, memory_peak_mb=7_000, cpu_s=10), 8_000, None, 8)
    assert slow == [
        "start-up: 10 s of the slot's 15 s passed before the first step (torchrun, rendezvous, "
        "checks, data): the fewer and longer the slots, the less of it (`slurm.runtime`, "
        "`train.epochs`)"
    ]


def test_steps_that_wait_for_their_data_are_flagged() -> None:
    waited = attempt(1_500, memory_peak_mb=7_000, cpu_s=11_000, data_wait_share=0.43)
    assert waste.flags(waited, 8_000, 30, 8) == [
        "data: the steps waited 43% of the training for their batches; read them faster: more "
        "DataLoader workers (`launch.loader_workers`), or the data packed into one file, "
        "decoded once (imagefolder's `pack: true`), or streamed from shards (docs/data.md); "
        "`ddppipe time-loader` times the loader alone"
    ]
    fed = attempt(1_500, memory_peak_mb=7_000, cpu_s=11_000, data_wait_share=0.2)
    assert waste.flags(fed, 8_000, 30, 8) == []


def test_a_well_used_allocation_has_no_flag() -> None:
    assert waste.flags(attempt(1_500, memory_peak_mb=7_000, cpu_s=11_000), 8_000, 30, 8) == []


def test_queue_wait_of_a_requeued_slot_counts_from_its_requeue() -> None:
    from ddppipe.slurm import scontrol

    job = {"SubmitTime": "2026-11-23T10:00:00", "EligibleTime": "2026-11-23T10:02:00",
           "StartTime": "2026-11-23T10:02:45"}  # fmt: skip
    assert scontrol.queue_seconds(job) == 45.0
    assert scontrol.queue_seconds({"StartTime": "Unknown"}) == 0.0


def test_an_idle_gpu_is_flagged() -> None:
    found = waste.flags(
        attempt(1_500, memory_peak_mb=7_000, cpu_s=11_000, gpu_utilisation=0.12), 8_000, 30, 8
    )
    assert found == [
        "GPU: the GPUs were busy 12% of the training (NVML); feed them more work a step "
        "(`train.batch_size`), or ask for fewer GPUs (`launch.nproc_per_node`)"
    ]


def test_utilisation_against_the_preflight_peak_of_every_node() -> None:
    peak = {"precision": "bf16", "gflops": {"gpu-a1": 400.0, "gpu-a2": 600.0}}
    record = {**attempt(600, achieved_gflops=300.0), "nodes": ["gpu-a1", "gpu-a2"], "peak": peak}
    assert utilisation.utilisation(record, "bf16", 4) == (
        0.3,
        "1,000 GFLOP/s bf16 GEMM peak, measured",
    )


def test_utilisation_falls_back_to_the_gpu_datasheet_then_to_nothing() -> None:
    h100 = attempt(600, achieved_gflops=98_900.0, gpu_name="NVIDIA H100 80GB HBM3")
    assert utilisation.utilisation({**h100, "nodes": ["n1"]}, "bf16", 2) == (
        0.05,
        "1,978,000 GFLOP/s bf16, NVIDIA H100 80GB HBM3 datasheet",
    )
    cpu = attempt(600, achieved_gflops=30.0)
    assert utilisation.utilisation({**cpu, "nodes": ["n1"]}, "bf16", 2) is None
    partial = {**cpu, "nodes": ["n1", "n2"], "peak": {"gflops": {"n1": 100.0}}}
    assert utilisation.utilisation(partial, "bf16", 2) is None  # not every node measured


def test_gpu_usage_sampler_averages_and_keeps_the_peak() -> None:
    from ddppipe.training.measuring import gpu_usage

    readings = iter([(50.0, 1_000.0), (100.0, 3_000.0), (0.0, 2_000.0)])

    def read() -> tuple[float, float]:
        return next(readings)  # StopIteration after three: NVML "gone", sampling ends

    sampler = gpu_usage.Sampler(read, interval=0.001)
    sampler.start()
    sampler._thread.join(timeout=5)
    assert sampler.stop() == {
        "gpu_utilisation": 0.5, "gpu_memory_peak_mb": 3_000.0, "gpu_samples": 3
    }  # fmt: skip


def test_gpu_usage_without_nvml_gives_no_figures() -> None:
    from ddppipe.training.measuring import gpu_usage

    def read() -> tuple[float, float]:
        raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    sampler = gpu_usage.Sampler(read)
    sampler.start()
    assert sampler.stop() is None and "libnvidia-ml" in str(sampler.failed)


def test_a_nodes_memory_counts_the_ranks_shared_libraries_once() -> None:
    ranks = [("cn07", 600.0, 400.0), ("cn07", 680.0, 420.0), ("cn08", 600.0, 300.0)]
    assert efficiency.node_memory(ranks) == {"cn07": 1_700.0, "cn08": 900.0}


def test_a_process_peak_and_its_file_backed_part() -> None:
    peak, files = efficiency.process_memory("self")
    rusage_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # read apart
    assert abs(peak - rusage_mb) < 16, (peak, rusage_mb)
    assert 1.0 < files < peak  # python's own libraries at least
    assert efficiency.process_memory("0") == (0.0, 0.0)  # no such process


def test_the_gemm_peak_fits_its_measuring_time_on_any_cpu() -> None:
    """The preflight measures every rank's GEMM peak within its 90 s step: on a CPU without
    native bf16 (AVX2 only) one 2048-square bf16 product took about a minute a rank (four
    ranks on two cores: the step timed out); a smaller product measures it instead."""
    import time

    import torch

    from ddppipe.training.measuring import peak

    for precision in ("fp32", "bf16"):
        started = time.perf_counter()
        assert peak.gemm_gflops(torch.device("cpu"), precision) > 0
        assert time.perf_counter() - started < 5.0, precision
