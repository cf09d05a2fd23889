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
happens in the script's loop). What it knows of the slot comes from the slot record
(:mod:`ddppipe.core.slot`) that ``ddppipe launch`` writes for every process; a script that
does not import ddppipe reads the same JSON file, named by ``$DDPPIPE_SLOT``.
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

from ddppipe.core import slot
from ddppipe.runstate import preemption
from ddppipe.runstate.state import StateDir
from ddppipe.training.measuring import heartbeat

STOP = preemption.EXIT_CODE  # the exit status of "stopped after a checkpoint: continue me"


def _state() -> StateDir:
    """The run's state folder, as the launcher names it (the working folder without one)."""
    found = slot.read()
    return StateDir(Path(found.state if found else "."))


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
    found = slot.read()
    use = found.device if found else None  # the run spec's device, which the launcher passes on
    if use not in ("gpu", "cpu"):
        raise RuntimeError(
            f"the slot record's device is {use!r}, not gpu or cpu: job.info() serves a script "
            "that `ddppipe launch` starts (the train rule, with the run's decided device); run "
            "it through the workflow (config key script:)"
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
        node=socket.gethostname(), attempt=found.attempt if found else 1, device=str(device),
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
    found = slot.read()
    return wrapping.wrap(
        model.to(device), device, found.strategy if found else "ddp", world // local, local,
        bf16=bf16, activation_checkpointing=bool(found and found.activation_checkpointing),
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
    if flag and not _stopping and int(os.environ.get("RANK", "0")) == 0 and slot.read():
        _stopping = True
        if _logged_from is not None:
            _progress(end_step=_last_step)
        preemption.record(_state(), signum, str(checkpoint_dir()))
    return flag


def _folder(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def checkpoint_dir() -> Path:
    """Where to save and find checkpoints: the run's state folder, kept across requeues."""
    return _folder(_state().checkpoints)


def output_dir() -> Path:
    """Where to put the files the run produces (weights, tables); published when complete."""
    return _folder(_state().outputs)


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
    found = slot.read()
    if _tracker is None and found and (found.tensorboard or found.mlflow):
        from ddppipe.training.tracking import run_tracking

        _tracker = run_tracking.Tracker(
            Path(found.tensorboard) if found.tensorboard else None, state,
            mlflow_uri=found.mlflow, run_name=found.run,
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
