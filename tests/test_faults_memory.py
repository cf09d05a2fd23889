"""Memory seen and named (#35, #41): each rank's peak memory in the summary, and a rank out of
memory (``MemoryError``, CUDA's ``OutOfMemoryError``, torch's CPU allocator under an
address-space limit, the OOM killer in a memory-limited cgroup) or killed by a signal named as
the slot's cause, not a survivor's follow-on error. The launches run 2 ranks on tiny MNIST
(gloo, CPU)."""

from __future__ import annotations

import json
import os
import signal
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from bench import sweep_table
from ddppipe.core import env_names, slot
from ddppipe.launching import resolve
from ddppipe.reports import memory_line, summary, summary_html
from ddppipe.runstate import failures, out_of_memory
from ddppipe.runstate.state import StateDir
from ddppipe.settings import layout, sweep
from ddppipe.sweeps import trials
from ddppipe.training.measuring import rank_memory
from tests import cgroups
from tests.conftest import run_cli
from tests.tiny import TinyData, make_tiny, tiny_config

HINT = ("to fit: launch.strategy: fsdp (shards parameters, gradients and optimizer state), a "
        "smaller train.batch_size, or train.activation_checkpointing: true (recomputes each "
        "block's activations in the backward)")  # fmt: skip
HOST = socket.gethostname()
MB, GIB = 1024**2, 1024**3

# A user's task whose forward fails on rank 1 at its 3rd training batch: FAULT is replaced.
FAULTY_TASK = '''\
"""MNIST with my linear model."""

import os
import signal

import torch
from torch import nn

from ddppipe.tasks.mnist import ARGS_SCHEMA, datasets, prepare  # noqa: F401


class Linear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(28 * 28, 10)
        self.batches = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled():
            self.batches += 1
            if os.environ["RANK"] == "1" and self.batches == 3:
                FAULT
        return self.fc(x.flatten(1))


def model(args: dict) -> nn.Module:
    return Linear()
'''


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyData:
    return make_tiny(tmp_path_factory.mktemp("tiny"))  # 256 samples: 8 steps of 32 an epoch


def launch(workdir: Path, tiny: TinyData, name: str, fault: str | None,
           monkeypatch: pytest.MonkeyPatch,
           preexec_fn: Callable[[], None] | None = None) -> tuple[Path, int, str]:  # fmt: skip
    """``ddppipe launch`` (as the train rule runs it) of a 1-epoch run of the faulty task
    with ``fault`` (None: the built-in MNIST task), ``preexec_fn`` run in the launcher before
    it starts; its run folder, exit status and stderr."""
    cfg = tiny_config(tiny, epochs=1)
    cfg["run"] = name
    if fault is not None:
        task = workdir / "tasks" / f"{name}.py"
        task.parent.mkdir(parents=True, exist_ok=True)
        task.write_text(FAULTY_TASK.replace("FAULT", fault))
        cfg["task"] = f"tasks/{name}.py"
    run = workdir / "results" / name
    run.mkdir(parents=True)
    monkeypatch.chdir(workdir)
    resolve.write_resolved(cfg, run / "config.yaml")
    result = run_cli(
        "launch", f"--config={run / 'config.yaml'}", f"--data={tiny.data_dir}",
        f"--state={run / 'state'}", f"--checkpoint={run / 'train/final.pt'}",
        f"--metrics={run / 'train/metrics.jsonl'}", cwd=workdir, check=False,
        preexec_fn=preexec_fn,
    )  # fmt: skip
    return run, result.returncode, result.stderr


def machine_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def test_a_memory_error_on_rank_1_is_out_of_memory(
    tmp_path: Path, tiny: TinyData, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 raises MemoryError: the slot's outcome is out of memory, its cause names rank 1,
    its peak host memory (plausible: torch is loaded, less than the machine) and the fix."""
    run, code, stderr = launch(tmp_path, tiny, "hungry", "raise MemoryError", monkeypatch)
    assert code == 1, stderr
    history = json.loads((run / "state/attempts.json").read_text())
    assert [a["outcome"] for a in history] == ["out of memory"]
    failure = history[0]["failure"]
    assert (failure["rank"], failure["type"], failure["step"]) == (1, "MemoryError", 3)
    peak, total = failure["memory"]["peak"], failure["memory"]["total"]
    assert failure["memory"]["kind"] == "host"
    assert 50 * MB < peak < total <= machine_bytes()
    detail = history[0]["detail"]
    assert detail.startswith(f"out of memory on rank 1 ({HOST}): peak ")
    assert " GiB host memory (MemoryError at tasks/hungry.py:" in detail
    assert detail.endswith(f"(in forward), step 3 (epoch 1)); {HINT}")
    assert summary.build(run).lines[-1] == ("failed", detail)
    assert f"training failed: {detail}" in stderr
    print("(MemoryError)", detail)


# Rank 1 limits its address space (ulimit -v) to what it has mapped plus 1 GiB, then asks
# torch's CPU allocator for 4 GiB: "DefaultCPUAllocator: can't allocate memory" (RuntimeError).
ADDRESS_SPACE_FAULT = (
    "import resource; vm = int(next(line for line in open('/proc/self/status') "
    "if line.startswith('VmSize')).split()[1]) * 1024; "
    "hard = resource.getrlimit(resource.RLIMIT_AS)[1]; "
    "resource.setrlimit(resource.RLIMIT_AS, (vm + 2**30, hard)); "
    "torch.empty(4 * 2**30, dtype=torch.uint8)"
)  # fmt: skip


def test_an_allocation_past_the_address_space_limit_is_out_of_memory(
    tmp_path: Path, tiny: TinyData, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1's tensor does not fit its address-space limit: torch's CPU allocator raises a
    RuntimeError, named out of memory with the 4 GiB asked for, the limit and the fix."""
    run, code, stderr = launch(tmp_path, tiny, "asked", ADDRESS_SPACE_FAULT, monkeypatch)
    assert code == 1, stderr
    history = json.loads((run / "state/attempts.json").read_text())
    assert [a["outcome"] for a in history] == ["out of memory"]
    failure = history[0]["failure"]
    assert (failure["rank"], failure["type"], failure["step"]) == (1, "RuntimeError", 3)
    assert "DefaultCPUAllocator: can't allocate memory" in failure["message"]
    figures = failure["memory"]
    assert (figures["kind"], figures["asked"]) == ("host", 4 * GIB)
    assert 50 * MB < figures["peak"] < figures["total"] <= machine_bytes()
    assert GIB < figures["address_space"] < 4 * GIB + GIB  # a torch rank's mappings + 1 GiB
    detail = history[0]["detail"]
    assert detail.startswith(f"out of memory on rank 1 ({HOST}): peak ")
    assert " GiB host memory, asking for 4.0 GiB more under an address-space limit of " in detail
    assert " GiB (ulimit -v) (RuntimeError at tasks/asked.py:" in detail
    assert detail.endswith(f"(in forward), step 3 (epoch 1)); {HINT}")
    lines = dict(summary.build(run).lines)
    assert lines["attempts"] == "1 slot(s): 1 out of memory"
    assert summary.build(run).lines[-1] == ("failed", detail)
    assert f"training failed: {detail}" in stderr
    print("(address space)", detail)


def test_the_cpu_allocators_failure_is_classified_with_its_figures() -> None:
    """torch's message for a CPU tensor that cannot be allocated is host memory, with the
    bytes asked for; its cause names them and the address-space limit."""
    message = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't "
               "allocate memory: you tried to allocate 4294967296 bytes. Error code 12 (Cannot "
               "allocate memory)")  # fmt: skip
    error = RuntimeError(message)
    assert out_of_memory.kind(error) == "host"
    assert out_of_memory.kind(RuntimeError("can't allocate a slot")) is None
    found = out_of_memory.figures(error)
    assert found is not None
    assert (found["kind"], found["asked"]) == ("host", 4 * GIB)
    failure = failures.Failure(
        rank=2, host="cn08", time=1.0, type="RuntimeError", message=message,
        frame="tasks/big.py:12 (in forward)", step=7, epoch=1, restart=0, traceback="",
        memory={"kind": "host", "peak": 3 * GIB, "total": 64 * GIB, "asked": 4 * GIB,
                "address_space": 6 * GIB},
    )  # fmt: skip
    assert failure.outcome() == "out of memory"
    assert failure.cause() == (
        "out of memory on rank 2 (cn08): peak 3.0 of 64.0 GiB host memory, asking for 4.0 GiB "
        "more under an address-space limit of 6.0 GiB (ulimit -v) (RuntimeError at "
        f"tasks/big.py:12 (in forward), step 7 (epoch 1)); {HINT}"
    )


CGROUP_LIMIT = 2 * GIB  # the launcher and 2 ranks fit (~0.8 GiB); rank 1's 4 GiB does not


@pytest.fixture
def memory_cgroup(tmp_path: Path) -> Iterator[Path]:
    """A new memory cgroup limited to CGROUP_LIMIT bytes (swap included); removed after."""
    with cgroups.memory_limited(CGROUP_LIMIT, tmp_path.name) as made:
        yield made


def test_a_rank_the_oom_killer_kills_in_a_memory_limited_cgroup_is_out_of_memory(
    tmp_path: Path, tiny: TinyData, monkeypatch: pytest.MonkeyPatch, memory_cgroup: Path
) -> None:
    """The launch runs in a cgroup of 2 GiB (a SLURM job's --mem); rank 1 fills a 4 GiB
    tensor and the kernel's OOM killer kills it: out of memory, killed by the OOM killer at the
    cgroup's limit, with the fix."""

    def enter() -> None:
        cgroups.enter(memory_cgroup)

    fault = "torch.ones(4 * 2**30, dtype=torch.uint8)"
    run, code, stderr = launch(tmp_path, tiny, "oom", fault, monkeypatch, preexec_fn=enter)
    assert code == 128 + 9, stderr
    history = json.loads((run / "state/attempts.json").read_text())
    assert [a["outcome"] for a in history] == ["out of memory"]
    failure = history[0]["failure"]
    assert (failure["rank"], failure["signal"]) == (1, "SIGKILL")
    assert failure["memory"] == {"kind": "host", "peak": None, "total": CGROUP_LIMIT,
                                 "oom_killer": True}  # fmt: skip
    detail = history[0]["detail"]
    assert detail == (
        f"out of memory on rank 1 ({HOST}): killed by the OOM killer (SIGKILL) at the limit of "
        f"2.0 GiB host memory; {HINT}"
    )
    assert summary.build(run).lines[-1] == ("failed", detail)
    assert f"training failed: {detail}" in stderr
    print("(OOM killer)", detail)


def test_a_rank_killed_by_sigkill_is_named_not_the_survivor(
    tmp_path: Path, tiny: TinyData, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 dies of SIGKILL (no Python exception, no record of its own; rank 0 then fails
    on its gloo connection): the launcher names rank 1 and the signal, with the usual cause."""
    fault = "os.kill(os.getpid(), signal.SIGKILL)"
    run, code, stderr = launch(tmp_path, tiny, "killed", fault, monkeypatch)
    assert code == 128 + 9, stderr
    history = json.loads((run / "state/attempts.json").read_text())
    assert [a["outcome"] for a in history] == ["killed by SIGKILL"]
    failure = history[0]["failure"]
    assert (failure["rank"], failure["host"], failure["signal"]) == (1, HOST, "SIGKILL")
    detail = history[0]["detail"]
    assert detail.startswith(f"rank 1 ({HOST}) killed by SIGKILL")
    assert detail.endswith(f"(the OOM killer is the usual cause; {HINT})")
    assert summary.build(run).lines[-1] == ("failed", detail)
    print("(SIGKILL)", detail)


def test_the_summary_shows_each_ranks_peak_memory(
    tmp_path: Path, tiny: TinyData, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A completed run's slot records the fullest rank's host peak and its model's parts; the
    summary (text and HTML) has the memory line."""
    run, code, stderr = launch(tmp_path, tiny, "fits", None, monkeypatch)
    assert code == 0, stderr
    history = json.loads((run / "state/attempts.json").read_text())
    record = history[0]["efficiency"]["memory"]
    assert record["host_rank"] in (0, 1) and record["host_node"] == HOST
    assert 50 * MB < record["host_peak"] < machine_bytes()
    cnn = record["parameters"]  # the built-in MNIST CNN's fp32 parameters
    assert 10_000 < cnn < 100 * MB
    assert record["gradients"] == cnn  # one per trainable parameter
    assert record["optimizer"] >= cnn  # SGD with momentum (one buffer) or Adam (two)
    assert "gpu_peak" not in record
    lines = dict(summary.build(run).lines)
    assert lines["memory"].startswith("peak per rank: ")
    assert f" host (rank {record['host_rank']} on {HOST}): parameters " in lines["memory"]
    assert lines["memory"].endswith("iB")  # MiB or GiB
    assert '<th scope="row">memory</th>' in summary_html.render(summary.build(run))
    print("(memory line)", lines["memory"])


def test_a_cuda_out_of_memory_error_is_classified_with_its_figures() -> None:
    """torch's OutOfMemoryError (its real class, raised on CPU here): GPU memory, the peak and
    the device's size read from its message where CUDA is not initialised."""
    message = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
               "79.19 GiB of which 1.06 GiB is free. Including non-PyTorch memory, this process "
               "has 78.12 GiB memory in use. Of the allocated memory 75.50 GiB is allocated by "
               "PyTorch")  # fmt: skip
    try:
        raise torch.OutOfMemoryError(message)
    except torch.OutOfMemoryError as e:
        error = e
    assert out_of_memory.kind(error) == "GPU"
    assert out_of_memory.kind(RuntimeError("boom")) is None
    found = out_of_memory.figures(error)
    assert found == {"kind": "GPU", "peak": int(78.12 * GIB), "total": int(79.19 * GIB)}
    failure = failures.Failure(
        rank=3, host="cn08", time=1.0, type="OutOfMemoryError", message="CUDA out of memory.",
        frame="tasks/big.py:12 (in forward)", step=40, epoch=1, restart=0, traceback="",
        memory=found,
    )  # fmt: skip
    assert failure.outcome() == "out of memory"
    assert failure.cause() == (
        "out of memory on rank 3 (cn08): peak 78.1 of 79.2 GiB GPU memory (OutOfMemoryError "
        f"at tasks/big.py:12 (in forward), step 40 (epoch 1)); {HINT}"
    )


def test_a_killed_rank_comes_before_earlier_follow_on_errors(tmp_path: Path) -> None:
    """The first failure is the killed rank's even when a survivor's gloo error was recorded
    first; the OOM killer's kill and another signal read as themselves."""
    survivor = failures.Failure(
        rank=0, host="cn07", time=1.0, type="DistBackendError", message="Connection closed",
        frame=None, step=5, epoch=1, restart=0, traceback="",
    )  # fmt: skip
    failures._write(tmp_path, survivor)
    killed = failures.killed(tmp_path, 1, signal.SIGKILL, 0, step=4, oom_killer=True)
    assert failures.first(tmp_path) == killed
    assert killed.outcome() == "out of memory"
    assert killed.cause().startswith(
        f"out of memory on rank 1 ({HOST}): killed by the OOM killer (SIGKILL)"
    )
    assert killed.cause().endswith(f" GiB host memory; {HINT}")
    segv = failures.killed(tmp_path, 2, signal.SIGSEGV, 0)
    assert segv.outcome() == "killed by SIGSEGV"
    assert segv.cause() == f"rank 2 ({HOST}) killed by SIGSEGV"
    # an exception's rank exits 1, though srun may exit 143 (a peer's agent ended by its
    # --kill-on-bad-exit as the failing one exits)
    assert survivor.outcome() == "crashed (exit 1)"


def test_rank_memory_counts_parameters_gradients_and_optimizer_state() -> None:
    """A Linear(4, 3) (15 fp32 parameters, 60 bytes) after one Adam step: gradients as large,
    Adam's two moments (120 bytes) and its two step counters (4 bytes each)."""
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    parts = rank_memory.parts(model.parameters(), optimizer)
    assert parts == {"parameters": 60, "gradients": 60, "optimizer": 128}
    figures = rank_memory.measure(torch.device("cpu"), model, optimizer)
    assert 50 * MB < figures["host_peak"] < machine_bytes()
    gpu = {"rank": 3, "node": "cn08", "host_peak": 2 * GIB, "gpu_peak": 10 * GIB,
           "gpu_reserved": 12 * GIB, "gpu_total": 80 * GIB, "parameters": GIB,
           "gradients": GIB, "optimizer": 2 * GIB}  # fmt: skip
    host = {"rank": 0, "node": "cn07", "host_peak": 3 * GIB, "gpu_peak": 9 * GIB,
            "gpu_reserved": 9 * GIB, "gpu_total": 80 * GIB}  # fmt: skip
    record = rank_memory.fullest([host, gpu])
    assert memory_line.line({"memory": record}) == ("memory", (
        "peak per rank: 3.0 GiB host (rank 0 on cn07), 10.0 of 80.0 GiB GPU (rank 3 on cn08; "
        "12.0 GiB reserved): parameters 1.0 GiB, gradients 1.0 GiB, optimizer state 2.0 GiB, "
        "activations and other 6.0 GiB"
    ))  # fmt: skip


def test_a_sweep_trial_out_of_memory_reads_once(tmp_path: Path) -> None:
    """The sweep's table says a trial ran out of memory once, with its cause."""
    cfg = sweep_table.base_config({"name": "lr", "parameters": {"train.lr": [0.1]}})
    found = sweep.from_config(cfg)
    assert found is not None
    trial = sweep.trials(found)[0]
    run = layout.RunLayout(trial.run, tmp_path / "results")
    sweep_table.write_config(run, sweep_table.resolved_trial(cfg, found, trial), found, trial)
    cause = f"out of memory on rank 1 (cn07): peak 1.2 of 7.6 GiB host memory; {HINT}"
    slot = sweep_table.attempt("out of memory", 1, exit_status=1, detail=cause, efficiency=None)
    sweep_table.write_json(run.state / "attempts.json", [slot])
    result = trials.read_trial(trial.name, trial.values, run, "test_accuracy", minimize=False)
    assert result.outcome_text == f"failed: {cause}"


def test_the_torchrun_agent_records_its_killed_ranks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under SLURM the node's agent names a rank that torchrun saw die of a signal (exit -9),
    in the workers' last start (a survivor's record says which); not a rank that exited 1."""
    from ddppipe.launching import agent as launching

    survivor = failures.Failure(
        rank=0, host="cn07", time=1.0, type="DistBackendError", message="Connection closed",
        frame=None, step=5, epoch=1, restart=2, traceback="",
    )  # fmt: skip
    folder = StateDir(tmp_path).failures
    failures._write(folder, survivor)
    env = slot.write(slot.Slot("oom", str(tmp_path)), tmp_path / "slot.json")
    monkeypatch.setenv(env_names.SLOT, env[env_names.SLOT])
    launching.record_killed({0: 1, 3: -9}, oom_kills_before=None)
    found = failures.first(folder)
    assert found is not None
    assert (found.rank, found.signal, found.restart) == (3, "SIGKILL", 2)
    assert found.outcome() == "killed by SIGKILL"
    assert {f.rank for f in failures.read_all(folder)} == {0, 3}


def test_an_agent_takes_the_last_start_from_the_records_names_alone(tmp_path: Path) -> None:
    """A node's agent reads no rank's record to know the workers' last start: the names in
    the failures folder say it (a torn record or another node's agent's counts too)."""
    folder = tmp_path / "failures"
    assert failures.last_restart(folder) == 0  # no folder yet
    folder.mkdir()
    for name, text in [
        ("restart1-rank0.json", "{}"),
        ("restart2-rank7.json", ""),
        ("restart3-rank-1-cn02.json", "not json"),
        ("restart9.txt", ""),
    ]:
        (folder / name).write_text(text)
    assert failures.last_restart(folder) == 3
