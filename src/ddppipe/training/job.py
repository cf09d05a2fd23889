"""The job API of a bring-your-own torchrun script (``script:`` in the config).

::

    from ddppipe import job
    job.info()               # rank, local_rank, world_size, device, node, attempt number
    job.should_stop()        # collective: True once the stop signal came or the end is near
    job.checkpoint_dir()     # where to save and find checkpoints (survives requeues)
    job.output_dir()         # files the run produces (published to results/<run>/train/outputs)
    job.log(step, **values)  # rank 0: metrics.jsonl and TensorBoard (and MLflow)
    model = job.shard(model) # DDP, FSDP2 or HSDP on this rank's device, per launch.strategy
    sys.exit(job.STOP)       # after saving on should_stop(): continue in the next slot

Importing this module installs the stop-signal handler (it only sets a flag; all I/O
happens in the script's loop). The same facts reach a script that does not import ddppipe
through environment variables (:data:`ENV`), set by ``ddppipe launch`` for every process.
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddppipe.runstate import preemption
from ddppipe.runstate.state import StateDir
from ddppipe.training import heartbeat

STOP = preemption.EXIT_CODE  # the exit status of "stopped after a checkpoint: continue me"

# What the launcher tells every process (ddppipe.launching.lifecycle sets them).
ENV = {
    "run": "DDPPIPE_RUN",  # the run's name
    "state": "DDPPIPE_STATE_DIR",  # results/<run>/state
    "checkpoints": "DDPPIPE_CHECKPOINT_DIR",  # <state>/checkpoints
    "outputs": "DDPPIPE_OUTPUT_DIR",  # <state>/outputs
    "tensorboard": "DDPPIPE_TENSORBOARD_DIR",  # results/<run>/tensorboard ('' when off)
    "mlflow": "DDPPIPE_MLFLOW_URI",  # '' when off
    "attempt": "DDPPIPE_ATTEMPT_NUMBER",  # 1, 2, ... : the slot of this run
    "end_time": "DDPPIPE_END_TIME",  # Unix time the job's time limit ends ('' without one)
    "stop_at": preemption.STOP_AT_ENV,  # Unix time should_stop() turns true ('' without one)
    "stop_signal": preemption.STOP_SIGNAL_ENV,  # the time-limit warning's signal: SIGUSR1
    "use": "DDPPIPE_DEVICE_USE",  # gpu (required) | cpu: the run spec's device
    "strategy": "DDPPIPE_STRATEGY",  # launch.strategy: ddp | fsdp | hsdp
    "activation_checkpointing": "DDPPIPE_ACTIVATION_CHECKPOINTING",  # 1 | 0 (train.)
}


def environment(
    run: str, state: StateDir, attempt: int, stop_signal: str, use: str,
    tensorboard: Path | None, mlflow: str | None, end_time: float | None = None,
    stop_at: float | None = None, strategy: str = "ddp", activation_checkpointing: bool = False,
) -> dict[str, str]:  # fmt: skip
    """The :data:`ENV` variables of one slot, for the launcher to export."""
    resolved = StateDir(state.root.resolve())
    values = {
        "run": run, "state": str(resolved.root), "checkpoints": str(resolved.checkpoints),
        "outputs": str(resolved.outputs), "tensorboard": str(tensorboard or ""),
        "mlflow": mlflow or "", "attempt": str(attempt),
        "end_time": "" if end_time is None else f"{end_time:.0f}",
        "stop_at": "" if stop_at is None else f"{stop_at:.0f}", "stop_signal": stop_signal,
        "use": use, "strategy": strategy,
        "activation_checkpointing": "1" if activation_checkpointing else "0",
    }  # fmt: skip
    return {ENV[key]: value for key, value in values.items()}


def _env(key: str) -> str:
    return os.environ.get(ENV[key], "")


def _state() -> StateDir:
    """The run's state folder, as the launcher names it (the working folder without one)."""
    return StateDir(Path(_env("state") or "."))


_guard = preemption.Guard()  # installed at import: a signal from now on is noted, never fatal
# The hang watchdog (ddppipe.launching.watchdog) sees a script's progress through its
# should_stop() and log() calls, from its first one on.
heartbeat.start(watched=False)


@dataclass(frozen=True)
class Info:
    rank: int
    local_rank: int
    world_size: int
    device: str  # "cuda:N" or "cpu": the device this rank should use
    node: str
    attempt: int  # this slot's number in the run's attempt history (1 for the first)


def info() -> Info:
    """Where this process is in the run (from torchrun's environment and the launcher's). On a
    GPU run it makes this rank's GPU the current device (``torch.cuda.set_device``): FSDP2's
    state, NCCL's communicators and :func:`should_stop`'s all-reduce go to the current one,
    cuda:0 for every rank otherwise."""
    from ddppipe.parallel import devices

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    use = _env("use")  # the run spec's device, which the launcher passes on
    if use not in ("gpu", "cpu"):
        raise RuntimeError(
            f"{ENV['use']} is {use!r}, not gpu or cpu: job.info() serves a script that "
            "`ddppipe launch` starts (the train rule, with the run's decided device); run it "
            "through the workflow (config key script:)"
        )
    device = devices.select(local_rank, local_size, use)  # type: ignore[arg-type]
    if device.type == "cuda":
        import torch

        global _on_own_gpu
        torch.cuda.set_device(device)
        _on_own_gpu = True
    return Info(
        rank=int(os.environ.get("RANK", "0")), local_rank=local_rank,
        world_size=int(os.environ.get("WORLD_SIZE", "1")),
        node=socket.gethostname(), attempt=int(_env("attempt") or 1), device=str(device),
    )  # fmt: skip


def shard(model: Any, bf16: bool = False) -> Any:
    """``model`` as this run trains it (``launch.strategy``), moved to this rank's device
    (:func:`info`): its ``DistributedDataParallel`` wrapper (ddp), or the model itself sharded
    in place by FSDP2 (fsdp: across every rank; hsdp: within a node, replicated across nodes),
    its blocks' activations checkpointed first with ``train.activation_checkpointing``. The
    blocks are those of the training loop (the model's ``shard_blocks``, else its
    ``nn.ModuleList``s' modules, else its children with parameters).

    Collective: call it on every rank after ``init_process_group``, and build the optimizer
    from what it returns. ``bf16``: FSDP computes in bfloat16 and reduces gradients in
    float32, DDP all-reduces bf16 gradients. Save and load an FSDP model's state with
    ``torch.distributed.checkpoint`` (its parameters are shards).
    """
    import torch
    import torch.distributed as dist

    from ddppipe.parallel import wrapping

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "job.shard() needs the process group: call "
            "torch.distributed.init_process_group() first (torchrun's environment says where "
            "to meet)"
        )
    world = dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if local < 1 or world % local:
        raise RuntimeError(
            f"job.shard(): LOCAL_WORLD_SIZE {local} does not divide the world size {world}: "
            "start the script with torchrun (ddppipe launch does), one node's processes each"
        )
    device = torch.device(info().device)
    return wrapping.wrap(
        model.to(device), device, _env("strategy") or "ddp", world // local, local, bf16=bf16,
        activation_checkpointing=_env("activation_checkpointing") == "1",
    )  # fmt: skip


_stopping = False
_on_own_gpu = False  # info() made this rank's GPU the current device


def should_stop() -> bool:
    """Collective: whether to save a checkpoint and exit with :data:`STOP` now.

    Every rank must call it at the same step: one all-reduce of the flag gives every rank
    the same answer (no rank is left waiting at a barrier). Without an initialized process
    group it answers for this process alone. Rank 0 notes the stop for the launcher.
    """
    global _stopping
    heartbeat.beat(heartbeat.STEP, _last_step)
    flag = _guard.requested()  # a stop signal arrived, or the stop time has passed
    signum = int(_guard.received or 0)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        import torch

        from ddppipe.parallel import distributed

        if dist.get_backend() == "nccl" and not _on_own_gpu:
            info()  # this rank's GPU the current device (once): NCCL's collective runs there
        # The signal too: rank 0 notes which one stopped the run even when it reached another
        # rank first (a signal to a job's steps reaches its nodes at different times).
        tensor = torch.tensor([int(flag), signum], device=distributed.collective_device())
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        flag, signum = bool(tensor[0]), int(tensor[1])
    if flag and not _stopping and int(os.environ.get("RANK", "0")) == 0 and _env("state"):
        _stopping = True
        if _logged_from is not None:
            _progress(end_step=_last_step)
        preemption.record(_state(), signum, str(checkpoint_dir()))
    return flag


def _folder(key: str, fallback: str) -> Path:
    path = Path(_env(key) or fallback)
    path.mkdir(parents=True, exist_ok=True)
    return path


def checkpoint_dir() -> Path:
    """Where to save and find checkpoints: the run's state folder, kept across requeues."""
    return _folder("checkpoints", "checkpoints")


def output_dir() -> Path:
    """Where to put the files the run produces (weights, tables); published when complete."""
    return _folder("outputs", "outputs")


_tracker: Any = None
_logged_from: int | None = None
_last_step: int | None = None


def log(step: int, **values: float) -> None:
    """(Rank 0; a no-op elsewhere) Record ``values`` at ``step``: metrics.jsonl, TensorBoard.

    A continuation logs again from its resumed step: lines of steps at or past the first
    step logged in this slot are dropped (as TensorBoard's purge), so no point is doubled.
    """
    global _tracker, _logged_from, _last_step
    heartbeat.beat(heartbeat.STEP, step)
    if int(os.environ.get("RANK", "0")) != 0:
        return
    _warn_if_nonfinite(step, values)
    _last_step = step
    state = _state()
    record = {"step": step, **{k: float(v) for k, v in values.items()}, "time": time.time()}
    if _logged_from is None:  # this slot's first point: drop what a killed slot logged past it
        _logged_from = step
        from ddppipe.core import jsonl

        kept = [r for r in jsonl.read(state.metrics) if r.get("step", -1) < step]
        jsonl.write(state.metrics, kept)
        _progress(start_step=step)
    with open(state.metrics, "a") as f:
        f.write(json.dumps(record) + "\n")
    if _tracker is None and (_env("tensorboard") or _env("mlflow")):
        from ddppipe.training import tracking

        _tracker = tracking.Tracker(
            Path(_env("tensorboard")) if _env("tensorboard") else None, state,
            mlflow_uri=_env("mlflow") or None, run_name=_env("run") or "run",
        )  # fmt: skip
    if _tracker is not None:
        _tracker.log(step, {k: float(v) for k, v in values.items()})


_warned_nonfinite = False


def _warn_if_nonfinite(step: int, values: dict[str, float]) -> None:
    """Say so (once) when a logged value is NaN or infinite; the summary warns too."""
    global _warned_nonfinite
    bad = [k for k, v in values.items() if not math.isfinite(float(v))]
    if bad and not _warned_nonfinite:
        _warned_nonfinite = True
        print(f"ddppipe job.log: non-finite {', '.join(bad)} at step {step}", file=sys.stderr)


def _progress(**changes: Any) -> None:
    """This slot's steps, for its attempt record (the first and last step the script logged)."""
    from ddppipe.runstate import attempts

    state = _state()
    attempts.write_progress(state, {**attempts.read_progress(state), **changes})
