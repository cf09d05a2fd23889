"""Each CPU rank on cores of its own: the share of a job's CPUs, and real ranks bound."""

import json
import os
import subprocess
import sys

from ddppipe import cpu_binding, workers

TWO_CPUS = sorted(os.sched_getaffinity(0))[:2]  # CI has 2 cores; the tests need 2

# Joins the process group (gloo's threads started) and prints every thread's CPUs.
REPORT = """
import json, os
from ddppipe import distributed
ctx = distributed.setup(use="cpu")
cpus = {}
for task in os.listdir("/proc/self/task"):
    for line in open(f"/proc/self/task/{task}/status"):
        if line.startswith("Cpus_allowed_list:"):
            cpus[task] = line.split()[1]
report = {"rank": ctx.local_rank, "cpus": sorted(set(cpus.values())), "threads": len(cpus)}
print(json.dumps(report))
distributed.teardown()
"""


def test_each_rank_gets_its_own_slice_of_exactly_enough_cpus() -> None:
    assert cpu_binding.share([0, 1], 1, 2, 1) == [1]
    assert cpu_binding.share([7, 5, 6, 4], 0, 2, 2) == [4, 5]
    assert cpu_binding.share([7, 5, 6, 4], 1, 2, 2) == [6, 7]
    assert cpu_binding.share([12, 40, 41, 13], 1, 4, 1) == [13]


def test_a_mask_of_another_size_is_left_to_the_kernel() -> None:
    # more CPUs than the ranks' threads: maybe shared with another job; fewer: oversubscribed
    assert cpu_binding.share([0, 1, 2, 3], 0, 2, 1) is None
    assert cpu_binding.share([0, 1], 0, 1, 1) is None
    assert cpu_binding.share([0, 1], 1, 2, 2) is None


def test_two_real_ranks_run_every_thread_on_their_own_cpu() -> None:
    port = workers.free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", REPORT],
            env=workers.rank_environment(env, rank, 2, port, 0),
            preexec_fn=lambda: os.sched_setaffinity(0, TWO_CPUS),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    reports = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        reports.append(json.loads(out.splitlines()[-1]))
    assert [r["rank"] for r in reports] == [0, 1]
    assert [r["cpus"] for r in reports] == [[str(TWO_CPUS[0])], [str(TWO_CPUS[1])]]
    assert all(r["threads"] > 1 for r in reports)  # gloo's threads, bound too


def test_a_single_rank_on_two_cpus_keeps_both() -> None:
    code = (
        "import os; from ddppipe import cpu_binding; "
        "print(cpu_binding.bind(0, 1, 1), sorted(os.sched_getaffinity(0)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], preexec_fn=lambda: os.sched_setaffinity(0, TWO_CPUS),
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert out.split() == ["None", f"[{TWO_CPUS[0]},", f"{TWO_CPUS[1]}]"]
