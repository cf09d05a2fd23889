"""The DDP training loop: in-memory data, sharded batches, checkpoints, distributed evaluation."""

from __future__ import annotations

import json
import logging
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from ddppipe import (
    __version__,
    atomic,
    attempts,
    checkpoint,
    config,
    devices,
    distributed,
    evaluate,
    heap,
    mnist,
    preemption,
    provenance,
    sharding,
)
from ddppipe.model import Net

log = logging.getLogger(__name__)

# Ranks agree on a pending stop signal every this many steps (one tiny all-reduce).
SIGNAL_CHECK_EVERY = 10


def optimizer_kernels(name: str, device: torch.device) -> dict[str, bool]:
    """Fused optimizer kernels where they exist for ``name`` on ``device``.

    AdamW and SGD have fused kernels on GPUs and CPUs (one pass over all parameters); Adadelta
    has none, and its multi-tensor (foreach) version is slower on CPU than the default loop.
    """
    if name in ("adamw", "sgd"):
        return {"fused": True}
    if name == "adadelta" and device.type == "cuda":
        return {"foreach": True}
    return {}


def make_optimizer(
    params: Any, train: dict[str, Any], device: torch.device
) -> torch.optim.Optimizer:
    name, lr, wd = train["optimizer"], train["lr"], train["weight_decay"]
    kernels = optimizer_kernels(name, device)
    if name == "adadelta":
        return torch.optim.Adadelta(params, lr=lr, weight_decay=wd, **kernels)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=wd, **kernels)
    if name == "sgd":
        return torch.optim.SGD(
            params, lr=lr, momentum=0.9, nesterov=True, weight_decay=wd, **kernels
        )
    raise ValueError(f"unknown optimizer {name!r}")


def speed_up_cuda() -> None:
    """Let cuDNN pick the fastest convolution algorithms and fp32 matmuls use TF32."""
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True


def make_scheduler(
    optimizer: torch.optim.Optimizer, train: dict[str, Any], steps_per_epoch: int
) -> torch.optim.lr_scheduler.LRScheduler:
    """A scheduler stepped once per optimizer step."""
    name = train["schedule"]
    if name == "step":
        return torch.optim.lr_scheduler.StepLR(optimizer, steps_per_epoch, gamma=train["gamma"])
    if name == "onecycle":
        return torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=train["lr"], total_steps=steps_per_epoch * train["epochs"]
        )
    if name == "constant":
        return torch.optim.lr_scheduler.ConstantLR(optimizer, factor=1.0, total_iters=0)
    raise ValueError(f"unknown schedule {name!r}")


def rank_seed(seed: int, epoch: int, rank: int) -> int:
    """Seed of a rank's dropout stream when no saved RNG state fits."""
    return (seed * 1_000_003 + epoch) * 4099 + rank + 1


@dataclass
class Paths:
    data_dir: Path
    state_dir: Path  # checkpoints and live metrics; survives failed jobs
    final_checkpoint: Path
    metrics: Path


class Trainer:
    """One rank's training run."""

    def __init__(self, cfg: dict[str, Any], paths: Paths, ctx: distributed.Context) -> None:
        self.cfg, self.paths, self.ctx = cfg, paths, ctx
        self.train_cfg = cfg["train"]
        self.config_hash = config.train_hash(cfg)
        self.dtype, self.memory_format = evaluate.numerics(self.train_cfg)
        cuda = ctx.device.type == "cuda"
        if cuda:
            devices.check_gpu(ctx.device.index, self.train_cfg["precision"])
        self.data = mnist.load(paths.data_dir).to(ctx.device)
        self.steps_per_epoch = sharding.steps_per_epoch(
            len(self.data.train), self.train_cfg["batch_size"]
        )
        torch.manual_seed(self.train_cfg["seed"])  # identical initial weights on every rank
        model = Net().to(ctx.device, memory_format=self.memory_format)
        self.model = model
        if cuda:
            speed_up_cuda()
        # Gradients live in DDP's all-reduce buckets: no copy in or out of them per step.
        self.ddp = DDP(
            model, device_ids=[ctx.device.index] if cuda else None, gradient_as_bucket_view=True
        )
        self.optimizer = make_optimizer(self.ddp.parameters(), self.train_cfg, ctx.device)
        self.scheduler = make_scheduler(self.optimizer, self.train_cfg, self.steps_per_epoch)
        self.store = checkpoint.Store(
            paths.state_dir / "checkpoints", self.train_cfg["keep_checkpoints"]
        )
        self.hosts: list[str] = [""] * ctx.world_size
        dist.all_gather_object(self.hosts, socket.gethostname())
        self.history: list[dict[str, Any]] = []
        self.epoch, self.step = 0, 0
        self.progress: dict[str, Any] = {"checkpoint_seconds": 0.0}

    # -- checkpoints ---------------------------------------------------------------------
    def _rng_state(self) -> dict[str, torch.Tensor]:
        state = {"cpu": torch.get_rng_state()}
        if self.ctx.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.ctx.device)
        return state

    def _set_rng(self, state: dict[str, torch.Tensor]) -> None:
        torch.set_rng_state(state["cpu"])
        if "cuda" in state and self.ctx.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda"], self.ctx.device)

    def snapshot(self) -> dict[str, Any]:
        """Collective: every rank must call it; only rank 0's result is complete."""
        rng: list[Any] = [None] * self.ctx.world_size
        dist.all_gather_object(rng, self._rng_state())
        return {
            "format": checkpoint.FORMAT,
            "config_hash": self.config_hash,
            "epoch": self.epoch,
            "step": self.step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": rng,
            "history": self.history,
            "meta": self.meta(),
        }

    def meta(self) -> dict[str, Any]:
        return {
            "world_size": self.ctx.world_size,
            "hosts": self.hosts,
            "backend": self.ctx.backend,
            "launcher": self.ctx.launcher,
            "device": self.ctx.device.type,
            "device_name": torch.cuda.get_device_name(self.ctx.device)
            if self.ctx.device.type == "cuda"
            else "cpu",
            "torch": str(torch.__version__),
            "ddppipe": __version__,
            "software": provenance.software(),
            "seed": self.train_cfg["seed"],
            "train": self.train_cfg,
        }

    def save_checkpoint(self) -> Path | None:
        """Collective: rank 0 writes; every rank raises CheckpointError if it could not."""
        started = time.perf_counter()
        snapshot = self.snapshot()

        def write() -> Path:
            path = self.store.save(snapshot)
            self._write_live_metrics()
            self._record_progress(
                end_step=self.epoch * self.steps_per_epoch + self.step,
                checkpoint=path.name,
                checkpoint_seconds=max(
                    self.progress["checkpoint_seconds"], time.perf_counter() - started
                ),
            )
            return path

        return checkpoint.rank0_writes(write)

    def resume(self) -> None:
        """Load the newest valid checkpoint of this config, if any (rank 0 decides)."""
        found: list[Any] = [None]
        if self.ctx.is_main:
            found[0] = self.store.latest(self.config_hash)
        dist.broadcast_object_list(found, src=0)
        snapshot = found[0]
        self._record_progress(
            resumed_from=snapshot and checkpoint.file_name(snapshot["epoch"], snapshot["step"]),
            start_step=snapshot and snapshot["epoch"] * self.steps_per_epoch + snapshot["step"],
        )
        if snapshot is None:
            torch.manual_seed(rank_seed(self.train_cfg["seed"], 0, self.ctx.rank))
            return
        self.model.load_state_dict(snapshot["model"])
        self.optimizer.load_state_dict(snapshot["optimizer"])
        self.scheduler.load_state_dict(snapshot["scheduler"])
        self.epoch, self.step, self.history = (
            snapshot["epoch"],
            snapshot["step"],
            snapshot["history"],
        )
        if len(snapshot["rng"]) == self.ctx.world_size:
            self._set_rng(snapshot["rng"][self.ctx.rank])
        else:
            log.warning("world size changed since the checkpoint: dropout streams are reseeded")
            torch.manual_seed(rank_seed(self.train_cfg["seed"], self.epoch, self.ctx.rank))
        if self.ctx.is_main:
            log.info("resumed at epoch %d step %d", self.epoch, self.step)

    def _record_progress(self, **changes: Any) -> None:
        """(Rank 0) This slot's progress for its attempt record (:mod:`ddppipe.attempts`)."""
        if not self.ctx.is_main:
            return
        if "start_step" in changes:
            changes["start_step"] = changes["start_step"] or 0
            changes["end_step"] = changes["start_step"]
        self.progress.update(changes)
        attempts.write_progress(self.paths.state_dir, self.progress)

    def _write_live_metrics(self) -> None:
        lines = "".join(json.dumps(m) + "\n" for m in self.history)
        atomic.write_text(self.paths.state_dir / "metrics.jsonl", lines)

    # -- loop ----------------------------------------------------------------------------
    def _stop_requested(self, guard: preemption.Guard) -> bool:
        flag = torch.tensor([1 if guard.requested() else 0], device=self.ctx.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _train_step(self, indices: torch.Tensor, global_count: int) -> torch.Tensor:
        train = self.data.train
        x = mnist.normalize(train.images[indices]).contiguous(memory_format=self.memory_format)
        y = train.labels[indices]
        with torch.autocast(
            self.ctx.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32
        ):
            logits = self.ddp(x)
        loss_sum = F.cross_entropy(
            logits.float(), y, reduction="sum", label_smoothing=self.train_cfg["label_smoothing"]
        )
        # DDP averages gradients over ranks; scaling by world/global count makes the result
        # the mean over the global batch whatever each rank's share is.
        (loss_sum * (self.ctx.world_size / global_count)).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return loss_sum.detach()

    def _run_epoch(self, guard: preemption.Guard) -> float | None:
        """Train the rest of the current epoch; return its seconds, or None when stopped."""
        n, batch = len(self.data.train), self.train_cfg["batch_size"]
        perm = sharding.epoch_permutation(n, self.train_cfg["seed"], self.epoch).to(self.ctx.device)
        self.ddp.train()
        loss_total = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        show = self.ctx.is_main and sys.stderr.isatty()
        steps = range(self.step, self.steps_per_epoch)
        bar = tqdm(steps, desc=f"epoch {self.epoch + 1}", disable=not show, leave=False)
        start = time.perf_counter()
        for step in bar:
            if step % SIGNAL_CHECK_EVERY == 0 and step > self.step and self._stop_requested(guard):
                self.step = step
                return None
            gbatch = sharding.global_batch(perm, step, batch)
            local = sharding.local_slice(gbatch, self.ctx.rank, self.ctx.world_size)
            loss_total += self._train_step(local, gbatch.numel())
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)
        seconds = time.perf_counter() - start
        dist.all_reduce(loss_total)
        self._epoch_loss = float(loss_total) / (n - self.step * batch)
        self._epoch_images = n - self.step * batch
        return seconds

    def _evaluate(self) -> evaluate.Counts:
        test = self.data.test
        lo, hi = sharding.eval_range(len(test), self.ctx.rank, self.ctx.world_size)
        shard = mnist.Split(test.images[lo:hi], test.labels[lo:hi])
        result = evaluate.counts(
            self.model, shard, self.train_cfg["eval_batch_size"], self.dtype, self.memory_format
        )
        if self.ctx.device.type == "cuda":
            result = evaluate.Counts(
                result.loss_sum.to(self.ctx.device), result.confusion.to(self.ctx.device)
            )
        return result.all_reduce()

    def run(self, guard: preemption.Guard) -> None:
        """Resume, train to the last epoch, write the outputs; raise Preempted on a signal.

        ``guard`` was installed when the process started, so a signal that arrives while it
        loads data, joins the group or resumes stops it at its first step check.
        """
        self.resume()
        while self.epoch < self.train_cfg["epochs"]:
            train_seconds = self._run_epoch(guard)
            if train_seconds is None:
                self._stop(guard, self.save_checkpoint())
            eval_start = time.perf_counter()
            counts = self._evaluate()
            eval_seconds = time.perf_counter() - eval_start
            self.epoch, self.step = self.epoch + 1, 0
            self.history.append(
                {
                    "epoch": self.epoch,
                    "train_loss": self._epoch_loss,
                    "test_loss": counts.loss,
                    "test_accuracy": counts.accuracy,
                    "images_per_s": self._epoch_images / train_seconds,
                    "epoch_seconds": train_seconds + eval_seconds,
                    "train_seconds": train_seconds,
                    "lr": self.scheduler.get_last_lr()[0],
                    "world_size": self.ctx.world_size,
                    "time": time.time(),  # Unix time at the end of this evaluation
                }
            )
            if self.ctx.is_main:
                log.info("epoch %d: %s", self.epoch, json.dumps(self.history[-1]))
            last = self.epoch == self.train_cfg["epochs"]
            stop = not last and self._stop_requested(guard)
            if last or stop or self.epoch % self.train_cfg["checkpoint_every"] == 0:
                path = self.save_checkpoint()
            if stop:
                self._stop(guard, path)
        self._write_outputs()  # a signal now is noted and changes nothing: the run completes

    def _stop(self, guard: preemption.Guard, path: Path | None) -> None:
        """After the checkpoint: leave the launcher a note (rank 0), then raise Preempted."""
        signum = guard.received or 0
        if self.ctx.is_main:
            if guard.received_at is not None:  # signal to checkpoint written: what a stop takes
                self._record_progress(stop_seconds=time.monotonic() - guard.received_at)
            preemption.record(self.paths.state_dir, signum, str(path))
        raise preemption.Preempted(signum, str(path))

    def _write_outputs(self) -> None:
        """Collective: rank 0 writes; every rank raises CheckpointError if it could not."""
        snapshot = self.snapshot()

        def write() -> None:
            checkpoint.save(snapshot, self.paths.final_checkpoint)
            lines = "".join(json.dumps(m) + "\n" for m in self.history)
            atomic.write_text(self.paths.metrics, lines)

        checkpoint.rank0_writes(write)


def train(cfg: dict[str, Any], paths: Paths, guard: preemption.Guard) -> None:
    """Join the process group and train; every launched process calls this."""
    heap.keep_freed_memory()
    ctx = distributed.setup(cfg["launch"]["backend"], use=devices.use(cfg))
    try:
        Trainer(cfg, paths, ctx).run(guard)
    except BaseException:
        distributed.teardown(synchronize=False)  # the others may never get to a barrier
        raise
    distributed.teardown()
