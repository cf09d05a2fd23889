"""Each CPU rank on cores of its own: the share of a job's CPUs, and real ranks bound; each GPU
rank on cores of its GPU's NUMA node (a two-socket machine's topology as sysfs shows it)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddppipe.launching import workers
from ddppipe.parallel import cpu_binding

TWO_CPUS = sorted(os.sched_getaffinity(0))[:2]  # CI has 2 cores; the tests need 2

# Joins the process group (gloo's threads started) and prints the CPUs of its main thread and
# of the group's threads (gloo's I/O loop and work threads), by thread name.
REPORT = """
import json, os
from ddppipe.parallel import distributed
ctx = distributed.setup(use="cpu")
main, group = None, set()
for task in os.listdir("/proc/self/task"):
    status = dict(line.split(":", 1) for line in open(f"/proc/self/task/{task}/status"))
    cpus = status["Cpus_allowed_list"].strip()
    if int(task) == os.getpid():
        main = cpus
    elif "gloo" in status["Name"]:
        group.add(cpus)
print(json.dumps({"rank": ctx.local_rank, "main": main, "group": sorted(group)}))
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


def test_two_real_ranks_train_on_their_own_cpu_their_groups_threads_on_both() -> None:
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
    assert [r["main"] for r in reports] == [str(TWO_CPUS[0]), str(TWO_CPUS[1])]
    both = ",".join(map(str, TWO_CPUS)) if TWO_CPUS[1] > TWO_CPUS[0] + 1 else "-".join(
        map(str, TWO_CPUS))  # fmt: skip
    assert [r["group"] for r in reports] == [[both], [both]]  # (each wakes for every message)


def test_a_single_rank_on_two_cpus_keeps_both() -> None:
    code = (
        "import os; from ddppipe.parallel import cpu_binding; "
        "print(cpu_binding.bind(0, 1, 1), sorted(os.sched_getaffinity(0)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], preexec_fn=lambda: os.sched_setaffinity(0, TWO_CPUS),
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert out.split() == ["None", f"[{TWO_CPUS[0]},", f"{TWO_CPUS[1]}]"]


def two_socket_sysfs(root: Path) -> Path:
    """sysfs of 2 sockets (NUMA nodes) of 8 cores with 2 hyperthreads: CPU c and c + 16 are
    siblings; node 0 holds cores 0-7 (CPUs 0-7,16-23), node 1 cores 8-15 (8-15,24-31)."""
    for node, cpus in ((0, "0-7,16-23"), (1, "8-15,24-31")):
        folder = root / f"devices/system/node/node{node}"
        folder.mkdir(parents=True)
        (folder / "cpulist").write_text(cpus + "\n")
    for cpu in range(32):
        folder = root / f"devices/system/cpu/cpu{cpu}/topology"
        folder.mkdir(parents=True)
        (folder / "thread_siblings_list").write_text(f"{cpu % 16},{cpu % 16 + 16}\n")
    for slot, node in ((0x1B, 0), (0x43, 0), (0x9C, 1), (0xC1, -1)):
        folder = root / f"bus/pci/devices/0000:{slot:02x}:00.0"
        folder.mkdir(parents=True)
        (folder / "numa_node").write_text(f"{node}\n")
    return root


@pytest.fixture
def topology(tmp_path: Path) -> cpu_binding.Topology:
    return cpu_binding.Topology.read(two_socket_sysfs(tmp_path))


def test_sysfs_topology_and_pci_numa_nodes(tmp_path: Path) -> None:
    sys_root = two_socket_sysfs(tmp_path)
    topology = cpu_binding.Topology.read(sys_root)
    assert [topology.node[c] for c in (0, 7, 8, 16, 24, 31)] == [0, 0, 1, 0, 1, 1]
    assert [topology.core[c] for c in (0, 16, 9, 25)] == [0, 0, 9, 9]
    assert [cpu_binding.pci_numa_node(0, bus, 0, sys_root) for bus in (0x1B, 0x9C, 0xC1)] == [
        0, 1, 0,  # -1: a machine of one node
    ]  # fmt: skip
    assert cpu_binding.cpu_list("0-2,5,7-8\n") == [0, 1, 2, 5, 7, 8]
    here = cpu_binding.Topology.read()  # this machine's: every usable CPU on a known node
    assert set(os.sched_getaffinity(0)) <= set(here.node)


def test_gpu_ranks_split_the_cores_of_their_gpus_node(topology: cpu_binding.Topology) -> None:
    every_cpu = list(range(32))
    four_gpus = {0: 0, 1: 0, 2: 1, 3: 1}  # two on each socket
    assert cpu_binding.gpu_share(every_cpu, topology, four_gpus, 0) == [0, 1, 2, 3, 16, 17, 18, 19]
    assert cpu_binding.gpu_share(every_cpu, topology, four_gpus, 1) == [4, 5, 6, 7, 20, 21, 22, 23]
    assert cpu_binding.gpu_share(every_cpu, topology, four_gpus, 3) == [
        12, 13, 14, 15, 28, 29, 30, 31,
    ]  # fmt: skip
    node_0 = [*range(8), *range(16, 24)]  # 8 cores: 2, 3 and 3 for 3 GPUs, whole cores
    three_on_node_0 = {0: 0, 1: 0, 2: 0}
    assert [cpu_binding.gpu_share(node_0, topology, three_on_node_0, d) for d in range(3)] == [
        [0, 1, 16, 17], [2, 3, 4, 18, 19, 20], [5, 6, 7, 21, 22, 23],
    ]  # fmt: skip


def test_a_gpu_rank_gets_only_the_jobs_cpus_near_its_gpu(topology: cpu_binding.Topology) -> None:
    four_gpus = {0: 0, 1: 0, 2: 1, 3: 1}
    slurm_mask = [0, 1, 2, 3, 16, 17, 18, 19]  # 4 cores, all on node 0
    assert cpu_binding.gpu_share(slurm_mask, topology, four_gpus, 1) == [2, 3, 18, 19]
    assert cpu_binding.gpu_share(slurm_mask, topology, four_gpus, 2) is None  # none on node 1


def test_a_gpu_rank_stays_unbound_where_binding_would_idle_cpus(
    topology: cpu_binding.Topology,
) -> None:
    every_cpu = list(range(32))
    # 4 GPUs on node 0: 2 of its cores each, where the job's 16 cores make 4 a rank
    crowded = {0: 0, 1: 0, 2: 0, 3: 0}
    assert [cpu_binding.gpu_share(every_cpu, topology, crowded, d) for d in range(4)] == [None] * 4
    # a rank that sees only its own GPU (one per task), on node 1: binding would drop core 0
    assert cpu_binding.gpu_share([8, 9, 24, 25, 0, 16], topology, {0: 1}, 0) is None
    assert cpu_binding.gpu_share([8, 9, 24, 25], topology, {0: 1}, 0) == [8, 9, 24, 25]
    one_core = [0, 16]  # fewer cores than GPUs on the node
    assert cpu_binding.gpu_share(one_core, topology, {0: 0, 1: 0}, 0) is None
