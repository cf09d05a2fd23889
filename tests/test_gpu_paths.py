"""What a GPU changes, beyond DDP (tests/test_gpu.py): FSDP2 and HSDP in bf16 on CUDA, their
DCP checkpoints resumed on CPUs at another world size, warm ranks forked onto a GPU, a packed
slot's own GPU, the job API over NCCL, the collectives' timeout, deterministic CUDA runs that
`ddppipe reproduce` calls identical, CUDA out of memory named, and a DDP checkpoint's copy
taken on a stream of its own while the next step runs.

Each test's ``seconds`` is its expected time on one H100-class GPU (`make test-gpu`'s plan,
tests/gpu_plan.py); without a GPU each skips, named.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ddppipe.launching import resolve, warm, warm_client
from ddppipe.packing import worker
from ddppipe.settings import config
from ddppipe.training.measuring import allowances
from tests.conftest import run_cli
from tests.test_background_copy import holds_its_step
from tests.test_fsdp import ARGS as LM_ARGS
from tests.test_fsdp import lm_data  # noqa: F401 (a fixture)
from tests.test_reproduce import train_and_export
from tests.tiny import TinyData, tiny_config

GIB = 1024**3


def launch(
    run_dir: Path,
    data: Path,
    cfg: dict[str, Any] | None,
    gpus: bool = True,
    env: dict[str, str] | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """``ddppipe launch`` of ``cfg`` (resolved into ``run_dir``; None: its config is there) as
    the train rule runs it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.yaml"
    if cfg is not None:
        resolve.write_resolved(cfg, path, gpus=gpus)
    result = run_cli(
        "launch", f"--config={path}", f"--data={data}", f"--state={run_dir / 'state'}",
        f"--checkpoint={run_dir / 'final.pt'}", f"--metrics={run_dir / 'metrics.jsonl'}",
        f"--attempts={run_dir / 'attempts.json'}", env=env, check=False, cwd=run_dir,
    )  # fmt: skip
    if check:
        assert result.returncode == 0, result.stderr[-4000:]
    return result


def gpu_tiny(tiny: TinyData, **train: Any) -> dict[str, Any]:
    cfg = tiny_config(tiny, **train)
    cfg["launch"].update(nproc_per_node=1, device="gpu")
    return cfg


def history(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def user_task(folder: Path, name: str, body: str) -> Path:
    """A task file of MNIST's data and a model of the test's (``body`` defines ``model``)."""
    path = folder / f"{name}.py"
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f'"""MNIST with a model of the GPU suite ({name})."""\n\nimport os\n\nimport torch\n'
        "from torch import nn\n\nfrom ddppipe.tasks.mnist import ARGS_SCHEMA, datasets, "
        f"prepare  # noqa: F401\n\nPREPARE_ARGS = ('sha256',)\n\n{body}"
    )
    return path


# -- FSDP2 and HSDP in bf16 on CUDA; their DCP checkpoints resumed on CPUs -------------------


@pytest.mark.gpu(seconds=35)
@pytest.mark.parametrize(("strategy", "checkpointed"), [("fsdp", False), ("hsdp", True)])
def test_sharded_bf16_on_cuda_resumes_on_cpus_at_2_ranks(
    lm_data: Path,  # noqa: F811 (the fixture imported above)
    tmp_path: Path,
    strategy: str,
    checkpointed: bool,
    record_property: Any,
) -> None:
    """The charlm task sharded by FSDP2 (HSDP: a 1 x 1 mesh on one GPU) in bf16 on CUDA, with
    and without activation checkpointing, 2 epochs: DCP checkpoints of CUDA tensors (written
    in the background), whole weights in model.pt on the CPU. Its epoch-1 checkpoint resumed
    by 2 ranks on CPUs (gloo) trains epoch 2 only, to about the GPU's epoch-2 loss."""
    cfg = copy.deepcopy(tiny_config_lm())
    cfg["train"].update(precision="bf16", activation_checkpointing=checkpointed)
    cfg["launch"].update(strategy=strategy, nproc_per_node=1, device="gpu")
    gpu_run = tmp_path / "gpu"
    started = time.perf_counter()
    launch(gpu_run, lm_data, cfg)
    record_property("gpu_run_s", round(time.perf_counter() - started, 1))
    (attempt,) = json.loads((gpu_run / "attempts.json").read_text())
    assert (attempt["strategy"], attempt["world_size"]) == (strategy, 1)
    stored = sorted((gpu_run / "state" / "checkpoints").glob("ckpt-e*"))
    assert [p.name for p in stored] == ["ckpt-e0001-s000000", "ckpt-e0002-s000000"]
    assert (stored[0] / "COMMITTED").exists() and (stored[0] / ".metadata").exists()
    weights = torch.load(gpu_run / "model.pt", weights_only=True)  # no map_location
    assert {t.device.type for t in weights.values()} == {"cpu"}
    assert {t.dtype for t in weights.values()} == {torch.float32}  # bf16 computes, fp32 keeps
    gpu_losses = history(gpu_run)
    # the same resolved config on 2 CPU processes, from the GPU's epoch-1 checkpoint
    cpu_run = tmp_path / "cpu"
    shutil.copytree(stored[0], cpu_run / "state" / "checkpoints" / stored[0].name)
    resolved = config.load(gpu_run / "config.yaml")
    resolved["launch"].update(device="cpu", nproc_per_node=2)
    resolved["resolved"]["device"] = "cpu"
    config.write(resolved, cpu_run / "config.yaml")
    launch(cpu_run, lm_data, None)
    (attempt,) = json.loads((cpu_run / "attempts.json").read_text())
    assert attempt["resumed_from"] == stored[0].name and attempt["world_size"] == 2
    assert (attempt["start_step"], attempt["end_step"]) == (24, 48)  # epoch 2 only
    resumed = history(cpu_run)  # epoch 1's line is the GPU run's, kept in the checkpoint
    assert resumed[0] == gpu_losses[0] and resumed[1]["epoch"] == 2
    assert resumed[1]["train_loss"] == pytest.approx(gpu_losses[1]["train_loss"], rel=0.05)
    record_property(f"{strategy}_epoch2_loss_gpu_cpu",
                    [gpu_losses[1]["train_loss"], resumed[1]["train_loss"]])  # fmt: skip


def tiny_config_lm() -> dict[str, Any]:
    """tests/test_fsdp.py's charlm run (2 epochs, global batch 48)."""
    from tests.test_fsdp import lm_config

    cfg = lm_config("fsdp", 1)
    assert cfg["task_args"]["max_bytes"] == LM_ARGS["max_bytes"]
    return cfg


# -- warm ranks on a GPU ------------------------------------------------------------------------

CUDA_TOUCHING_TASK = """
from ddppipe.tasks import mnist


def datasets(data_dir, args):
    torch.zeros(1).pin_memory()  # pinned memory initializes CUDA in the process that loads
    return mnist.datasets(data_dir, args)


def model(args):
    return mnist.model(args)
"""


def started_server(folder: Path, name: str,
                   data: list[dict[str, Any]] | None = None) -> tuple[Any, Path]:  # fmt: skip
    """A warm server keeping ``data``, listening; its process and socket."""
    socket_path = warm.local_socket(f"gpu-suite-{os.getpid()}-{name}.sock")
    server = warm.start(socket_path, folder / f"{socket_path.stem}.log", data)
    env = {**os.environ, "DDPPIPE_WARM_SOCKET": str(socket_path)}
    deadline = time.monotonic() + 120
    while not warm_client.usable([sys.executable, "-m", "ddppipe", "train"], env):
        assert server.poll() is None and time.monotonic() < deadline, "the server did not listen"
        time.sleep(0.2)
    return server, socket_path


@pytest.mark.gpu(seconds=45)
def test_a_rank_forked_warm_trains_on_the_gpu_and_one_after_cuda_starts_cold(
    tiny: TinyData, tmp_path: Path
) -> None:
    """The warm server (it never touches CUDA) forks a GPU rank that trains with NCCL on its
    GPU; a server whose kept datasets touched CUDA forks none after: the rank starts cold,
    its launcher saying why, and trains on the GPU all the same."""
    from ddppipe.core import env_names

    server, socket_path = started_server(tmp_path, "plain")
    try:
        env = {env_names.WARM_SOCKET: str(socket_path)}
        result = launch(tmp_path / "warm", tiny.data_dir, gpu_tiny(tiny), env=env)
        assert "1 of 1 rank(s) forked warm by the warm server" in result.stderr
        assert history(tmp_path / "warm")[0]["epoch"] == 1
    finally:
        server.terminate()
        server.wait(timeout=30)
    task = user_task(tmp_path / "tasks", "pinning", CUDA_TOUCHING_TASK)
    cfg = gpu_tiny(tiny)
    cfg["task"] = str(task)
    resolved = resolve.write_resolved(cfg, tmp_path / "cold.yaml", gpus=True)
    keep = [{"task": str(task), "data_dir": str(tiny.data_dir), "args": resolved["task_args"]}]
    server, socket_path = started_server(tmp_path, "pinning", keep)
    log = tmp_path / f"{socket_path.stem}.log"
    try:
        deadline = time.monotonic() + 120
        while "every rank starts cold" not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        env = {env_names.WARM_SOCKET: str(socket_path)}
        result = launch(tmp_path / "cold", tiny.data_dir, cfg, env=env)
        assert "touched CUDA" in result.stderr and "starts cold" in result.stderr, result.stderr
        assert "forked warm" not in result.stderr
        assert history(tmp_path / "cold")[0]["epoch"] == 1
    finally:
        server.terminate()
        server.wait(timeout=30)


# -- a packed slot's own GPU ------------------------------------------------------------------


@pytest.mark.gpu(seconds=35)
def test_a_packed_slot_gets_its_own_gpu_and_one_slot_too_many_is_refused(
    tiny: TinyData, tmp_path: Path
) -> None:
    """A node's slots share out the allocation's GPUs, one each; a slot more than there are
    GPUs is refused (no two trials on one GPU); a trial in the last slot trains on its GPU."""
    count = torch.cuda.device_count()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") or ",".join(map(str, range(count)))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": visible}
    slots = worker.slots_of_node(count, env, gpus_each=1)
    assert [s.gpus for s in slots] == [[g] for g in visible.split(",")]
    with pytest.raises(worker.PackError, match="the trials would share GPUs"):
        worker.slots_of_node(count + 1, env, gpus_each=1)
    last = slots[-1]
    probe = run_cli("selfcheck", env={"CUDA_VISIBLE_DEVICES": ",".join(last.gpus)})
    assert json.loads(probe.stdout)["gpus"] == [torch.cuda.get_device_name(count - 1)]
    launch(tmp_path / "trial", tiny.data_dir, gpu_tiny(tiny),
           env={"CUDA_VISIBLE_DEVICES": ",".join(last.gpus)})  # fmt: skip
    assert history(tmp_path / "trial")[0]["epoch"] == 1


# -- the job API and the collectives' timeout over NCCL --------------------------------------

JOB_SCRIPT = """
import json, os, sys
import torch, torch.distributed as dist
from torch import nn
from ddppipe import job

info = job.info()
dist.init_process_group("nccl")
current = torch.cuda.current_device()
model = job.shard(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)), bf16=True)
x = torch.randn(16, 32, device=info.device)
model(x).float().square().mean().backward()
stop = job.should_stop()
if info.rank == 0:
    out = job.output_dir() / "probe.json"
    out.write_text(json.dumps({
        "device": info.device, "current": current, "world": info.world_size,
        "param_devices": sorted({p.device.type for p in model.parameters()}),
        "grads": all(p.grad is not None for p in model.parameters()), "stop": stop,
        "backend": dist.get_backend()}))
dist.destroy_process_group()
"""

PG_PROBE_TASK = """
import json


class Probe(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(28 * 28, 10)
        self.done = False

    def forward(self, x):
        if not self.done and os.environ.get("RANK") == "0":
            import torch.distributed as dist

            group = dist.distributed_c10d._get_default_group()
            backend = group._get_backend(torch.device("cuda"))
            with open(os.environ["GPU_PROBE_OUT"], "w") as f:
                json.dump({"timeout_s": backend.options._timeout.total_seconds(),
                           "backend": dist.get_backend(), "current": torch.cuda.current_device(),
                           "input": str(x.device)}, f)
            self.done = True
        return self.fc(x.flatten(1))


def model(args):
    return Probe()
"""


@pytest.mark.gpu(seconds=25)
def test_the_job_api_and_the_collectives_timeout_over_nccl(tiny: TinyData, tmp_path: Path) -> None:
    """A script's ``job.info()`` makes its GPU current, ``job.shard()`` puts the model on it
    (DDP, bf16 gradients), ``should_stop()`` all-reduces over NCCL; a task's NCCL process
    group has the timeout the watchdog's allowances give (``launch.hang_timeout_s: auto``)."""
    script = tmp_path / "probe_script.py"
    script.write_text(JOB_SCRIPT)
    cfg = tiny_config(tiny)
    cfg.update(run="probe", script=str(script), script_args=[])
    cfg["launch"].update(nproc_per_node=1, device="gpu")
    run = tmp_path / "script"
    run.mkdir()
    resolve.write_resolved(cfg, run / "config.yaml", gpus=True)
    result = run_cli("launch", f"--config={run / 'config.yaml'}", f"--state={run / 'state'}",
                     f"--outputs={run / 'outputs'}", f"--metrics={run / 'metrics.jsonl'}",
                     check=False, cwd=run)  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    probe = json.loads((run / "outputs" / "probe.json").read_text())
    assert probe == {"device": "cuda:0", "current": 0, "world": 1, "param_devices": ["cuda"],
                     "grads": True, "stop": False, "backend": "nccl"}  # fmt: skip
    task = user_task(tmp_path / "tasks", "pgprobe", PG_PROBE_TASK)
    cfg = gpu_tiny(tiny)
    cfg["task"] = str(task)
    out = tmp_path / "pg.json"
    launch(tmp_path / "task", tiny.data_dir, cfg, env={"GPU_PROBE_OUT": str(out)})
    seen = json.loads(out.read_text())
    assert seen["backend"] == "nccl" and seen["current"] == 0 and seen["input"] == "cuda:0"
    assert seen["timeout_s"] == allowances.collective_timeout_s("auto")


# -- deterministic CUDA runs ------------------------------------------------------------------

NO_DETERMINISTIC_KERNEL = """
class Pooled(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3)
        self.pool = nn.AdaptiveMaxPool2d(4)  # its CUDA backward has no deterministic kernel
        self.fc = nn.Linear(8 * 16, 10)

    def forward(self, x):
        return self.fc(self.pool(self.conv(x)).flatten(1))


def model(args):
    return Pooled()
"""


@pytest.mark.gpu(seconds=40)
def test_deterministic_cuda_runs_reproduce_identical_and_a_refused_op_is_named(
    tiny: TinyData, tmp_path: Path
) -> None:
    """``train.deterministic: true`` on CUDA: the run and its reproduction (`ddppipe
    reproduce`) have byte-identical weights, and it says identical; a model with an op that has
    no deterministic CUDA kernel fails naming it."""
    workdir = tmp_path / "work"
    shutil.copytree(tiny.data_dir, workdir / "resources" / "mnist")
    cfg = gpu_tiny(tiny, epochs=2, deterministic=True)
    cfg["run"] = "det"
    root = train_and_export(workdir, cfg, "det", gpus=True)
    result = run_cli("reproduce", "results/det", cwd=workdir, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().splitlines()[-1] == "identical", result.stdout
    digests = {hashlib.sha256((r / "export" / "model.pt").read_bytes()).hexdigest()
               for r in (root, workdir / "results" / "det-reproduced-1")}  # fmt: skip
    assert len(digests) == 1
    task = user_task(tmp_path / "tasks", "pooled", NO_DETERMINISTIC_KERNEL)
    cfg = gpu_tiny(tiny, deterministic=True)
    cfg["task"] = str(task)
    failed = launch(tmp_path / "refused", tiny.data_dir, cfg, check=False)
    assert failed.returncode != 0
    assert "adaptive_max_pool2d_backward_cuda has no deterministic kernel" in failed.stderr, (
        failed.stderr[-3000:]
    )


# -- CUDA out of memory -----------------------------------------------------------------------

OVERSIZED = """
class Oversized(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(28 * 28, 10)

    def forward(self, x):
        # every pixel of the batch widened 2**24 times: 32 x 784 x 16 Mi floats, ~1.6 TiB
        wide = x.flatten(1).unsqueeze(-1).expand(-1, -1, 2**24).contiguous()
        return self.fc(wide.mean(-1))


def model(args):
    return Oversized()
"""


@pytest.mark.gpu(seconds=20)
def test_cuda_out_of_memory_is_named_with_its_figures_and_the_fix(
    tiny: TinyData, tmp_path: Path
) -> None:
    """An allocation no GPU holds: the slot's outcome is out of memory, with the GPU's figures
    and what to change."""
    task = user_task(tmp_path / "tasks", "oversized", OVERSIZED)
    cfg = gpu_tiny(tiny)
    cfg["task"] = str(task)
    run = tmp_path / "oom"
    failed = launch(run, tiny.data_dir, cfg, check=False)
    assert failed.returncode != 0
    (attempt,) = json.loads((run / "state" / "attempts.json").read_text())
    assert attempt["outcome"] == "out of memory", attempt
    detail = attempt["detail"]
    assert detail.startswith("out of memory on rank 0 ("), detail
    assert " GiB GPU memory (OutOfMemoryError at " in detail and "oversized.py" in detail
    assert "launch.strategy: fsdp" in detail and "train.batch_size" in detail
    total = attempt["failure"]["memory"]["total"]
    assert abs(total - torch.cuda.get_device_properties(0).total_memory) < 2 * GIB


@pytest.mark.gpu(seconds=10)
@pytest.mark.usefixtures("one_rank")
def test_a_ddp_checkpoints_copy_on_its_own_cuda_stream_holds_the_weights_of_its_step(
    tmp_path: Path,
) -> None:
    """The CPU test's case (tests/test_background_copy.py) on the GPU: the buffers copied at
    once on the training's stream, the parameters and Adam's state by the worker on its own
    stream into pinned memory after the training's event, while the next forward and backward
    run; the step waits: the checkpoint holds, bitwise, the tensors at the save."""
    holds_its_step("cuda", tmp_path)
