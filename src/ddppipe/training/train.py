"""The data-parallel training loop of any task: sharded batches, checkpoints, evaluation.

The task (:mod:`ddppipe.tasks`) gives the model, the datasets and optionally the loss,
metrics and optimizer; everything else is here: device, DDP, FSDP or HSDP (``launch.strategy``),
mixed precision, the sharded and resumable data order, sharded asynchronous checkpoints, stop
on signal, evaluation, metrics and tracking.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from ddppipe import __version__, tasks
from ddppipe.core import heap, jsonl, system
from ddppipe.data import batches, sharding, staging
from ddppipe.parallel import devices, distributed, fsdp, software, wrapping
from ddppipe.runstate import attempts, failures, preemption
from ddppipe.settings import run_spec
from ddppipe.tasks import kept_datasets
from ddppipe.training import (
    allowances,
    checkpoint,
    efficiency,
    evaluate,
    files,
    heartbeat,
    optim,
    probes,
    pruning,
    rng,
    sharded_checkpoint,
)

log = logging.getLogger(__name__)

# Ranks agree on a pending stop signal and on a non-finite loss every this many steps (one
# tiny all-reduce).
SIGNAL_CHECK_EVERY = 10
ALL_FINITE = 2**62  # the first non-finite step's index when there was none


class Trainer:
    """One rank's training run."""

    def __init__(
        self, spec: run_spec.RunSpec, paths: files.Paths, ctx: distributed.Context
    ) -> None:
        self.spec, self.paths, self.ctx = spec, paths, ctx
        self.recipe = spec.train
        self.meter = efficiency.SlotMeter()
        self.task = tasks.load(spec.task, step="train (ddppipe train)")
        args = run_spec.plain(spec.task_args)  # a plain dict for the task's hooks
        heartbeat.beat("data")  # (the phases each have their own allowance: launching.watchdog)
        with self.meter.phase("stage" if spec.launch.stage_data else "data"):
            self.data_dir, found = staging.data_folder(
                paths.data_dir, spec.launch.stage_data, lambda: heartbeat.beat("data")
            )
        self.config_hash = spec.train_hash(found["digest"])
        self.dtype, self.memory_format = evaluate.numerics(
            self.recipe.precision, self.recipe.channels_last
        )
        cuda = ctx.device.type == "cuda"
        if cuda:
            devices.check_gpu(ctx.device.index, self.recipe.precision)
            self.meter.watch_gpu(ctx.device)
        elif self.dtype == torch.bfloat16 and ctx.rank == 0 and not system.cpu_computes_bf16():
            log.warning(
                "train.precision bf16 on a CPU that only emulates bfloat16 (no AVX512-BF16, "
                "AMX-BF16 or Arm BF16): several times slower than fp32 (set train.precision: "
                "fp32, or leave it null: the preset then picks fp32 on such CPUs)"
            )
        with self.meter.phase("data"):
            # (kept by the warm server that forked this rank, when it loaded the same data)
            train_set, test_set = kept_datasets.datasets(self.task, self.data_dir, args)
            cpus, threads = system.available_cpus(), torch.get_num_threads()
            self.train_data, self.test_data = (batches.Feed(
                part, ctx.device, batches.loader_workers(
                    spec.launch.loader_workers, part, cpus, ctx.local_world_size, threads),
            ) for part in (train_set, test_set))  # fmt: skip
        if len(self.test_data) < ctx.world_size:
            raise tasks.TaskError(
                f"task {spec.task}: {len(self.test_data)} test samples for {ctx.world_size} "
                "ranks; every rank evaluates a share: use a larger test set or fewer processes"
            )
        self.steps_per_epoch = sharding.steps_per_epoch(
            len(self.train_data), self.recipe.batch_size
        )
        heartbeat.beat("start-up")
        torch.manual_seed(self.recipe.seed)  # identical initial weights on every rank
        model = self.task.call("model", args).to(ctx.device, memory_format=self.memory_format)
        self.model = model
        if cuda:
            devices.speed_up_cuda()
        self.loss_fn = evaluate.training_loss(self.task, self.recipe.label_smoothing)
        self.sharded = spec.launch.strategy in fsdp.SHARDED
        if ctx.is_main:  # on the whole model: before FSDP shards it (its forward is collective)
            self.meter.flops_per_image = probes.flops_per_image(
                model, self.train_data.dataset, ctx.device, self.loss_fn, self.dtype,
                self.memory_format,
            )  # fmt: skip
        # What trains: the FSDP-sharded model itself, or its DDP wrapper.
        launch = spec.launch
        self.net = wrapping.wrap(
            model, ctx.device, launch.strategy, launch.nnodes, launch.nproc_per_node,
            bf16=self.dtype == torch.bfloat16,
            activation_checkpointing=self.recipe.activation_checkpointing,
        )  # fmt: skip
        self.eval_loss_fn = self.task.module.loss if self.task.has("loss") else None
        self.metrics_fn = self.task.module.metrics if self.task.has("metrics") else None
        if self.task.has("optimizer"):
            self.optimizer = self.task.call("optimizer", self.net.parameters(), args)
        else:
            self.optimizer = optim.make_optimizer(
                self.net.parameters(), self.recipe, ctx.device, self.sharded
            )
        self.scheduler = optim.make_scheduler(self.optimizer, self.recipe, self.steps_per_epoch)
        self.meter.watch_memory(ctx.device, model, self.optimizer)
        # Sharded checkpoints, saved in the background: their collectives have a group of
        # their own (sharing the training's can deadlock against its collectives).
        self.store = sharded_checkpoint.Store(
            paths.state.checkpoints, self.recipe.keep_checkpoints,
            group=dist.new_group(backend="gloo"),
        )  # fmt: skip
        self.hosts: list[str] = [""] * ctx.world_size
        dist.all_gather_object(self.hosts, socket.gethostname())
        self.history: list[dict[str, Any]] = []
        self.epoch, self.step = 0, 0
        self._final_eval: evaluate.Counts | None = None
        # The index of the first step (0: the run's first) whose loss was NaN or infinite: a
        # device-side flag, no host sync a step; the ranks agree on it with the stop flag.
        self._first_nonfinite = torch.full((), ALL_FINITE, dtype=torch.int64, device=ctx.device)
        self.progress: dict[str, Any] = {"checkpoint_seconds": 0.0}
        self._saving_step = 0  # the global step of the checkpoint in flight
        self.tracker = self._tracker() if ctx.is_main else None
        # A sweep's trial with pruning on: rank 0 reports to the sweep's study at epoch ends.
        trial = spec.trial if spec.trial is not None and spec.trial.prune is not None else None
        self.prunes = trial is not None
        self.pruner = pruning.TrialPruner(trial) if trial is not None and ctx.is_main else None
        self.pruned_at: int | None = None  # the epoch whose end pruned the run
        self._stop_signal = 0  # the stop signal any rank got, as the ranks agreed on it

    def _tracker(self) -> Any:
        """(Rank 0) TensorBoard (and MLflow) tracking, continued across every slot."""
        wanted = self.spec.tracking
        if not wanted.tensorboard and not wanted.mlflow:
            return None
        from ddppipe.training import mlflow_log, tracking

        folder = self.paths.state
        source = self.spec.task_source or {}  # null where no launcher resolved the task
        tags = {"git_commit": str(system.git_commit()["commit"]),
                "task": str(source.get("ref")), "task_sha256": str(source.get("sha256")),
                "config_hash": self.config_hash}  # fmt: skip
        if os.environ.get("SLURM_JOB_ID"):
            tags[f"slurm_job_{os.environ['SLURM_JOB_ID']}"] = socket.gethostname()
        tensorboard = folder.tensorboard if wanted.tensorboard else None
        return tracking.Tracker(
            tensorboard, folder, mlflow_uri=wanted.mlflow, run_name=self.spec.run,
            params=self.spec.as_dict(), tags=tags,  # MLflow's params: the config as written
            parent=mlflow_log.SweepParent.of(self.spec, folder),  # a trial: a child run
        )  # fmt: skip

    def _record_efficiency(self) -> None:
        """Collective: the slot's figures into rank 0's progress (its attempt record)."""
        figures = self.meter.collect(self.ctx.world_size)
        self._record_progress(efficiency=figures)

    def _track(self, step: int, values: dict[str, float], prefix: str = "") -> None:
        if self.tracker is not None:
            self.tracker.log(step, values, prefix)

    # -- checkpoints ---------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """Collective: the whole training state, full weights; only rank 0's is complete."""
        if self.sharded:
            weights, optimizer = sharded_checkpoint.full_state_dicts(self.model, self.optimizer)
        else:  # (on the CPU: a checkpoint loads on any machine, without map_location)
            weights = checkpoint.on_cpu(self.model.state_dict())
            optimizer = checkpoint.on_cpu(self.optimizer.state_dict())
        states = {"model": weights, "optimizer": optimizer,
                  "scheduler": self.scheduler.state_dict()}  # fmt: skip
        return checkpoint.snapshot(self.config_hash, self.epoch, self.step, states,
                                   self._rng_streams(), self.history, self.meta())  # fmt: skip

    def _rng_streams(self) -> list[Any]:
        """Collective: every rank's RNG state (rank 0's list complete)."""
        streams: list[Any] = [None] * self.ctx.world_size
        dist.all_gather_object(streams, rng.state(self.ctx.device))
        return streams

    def _parts(self) -> checkpoint.Trainable:
        return checkpoint.Trainable(self.model, self.optimizer, self.scheduler)

    def meta(self) -> dict[str, Any]:
        return {
            "world_size": self.ctx.world_size,
            "strategy": self.spec.launch.strategy,
            "hosts": self.hosts,
            "backend": self.ctx.backend,
            "launcher": self.ctx.launcher,
            "device": self.ctx.device.type,
            "device_name": torch.cuda.get_device_name(self.ctx.device)
            if self.ctx.device.type == "cuda"
            else "cpu",
            "torch": str(torch.__version__),
            "ddppipe": __version__,
            "software": software.stack(),
            "seed": self.recipe.seed,
            "train": dataclasses.asdict(self.recipe),
            "task": run_spec.plain(self.spec.task_source),
            "task_args": run_spec.plain(self.spec.task_args),
        }

    def save_checkpoint(self, wait: bool = False) -> Path | None:
        """Collective: every rank starts writing its part of a sharded checkpoint, in the
        background (``wait``: and waits until it is committed: before a stop or the end).
        Every rank raises CheckpointError if any could not write."""
        heartbeat.beat("checkpoint")
        started = time.perf_counter()
        self._checkpoint_written(self.store.wait())  # the previous one, if still in flight
        state = {"config_hash": self.config_hash, "epoch": self.epoch, "step": self.step,
                 "scheduler": self.scheduler.state_dict(), "rng": self._rng_streams(),
                 "history": self.history, "meta": self.meta()}  # fmt: skip
        tensors = sharded_checkpoint.tensors_of(self.model, self.optimizer)
        name = self.store.save(state, tensors)
        self._saving_step = self.epoch * self.steps_per_epoch + self.step
        if self.ctx.is_main:
            self._write_live_metrics()
        path = self.wait_for_checkpoint() if wait else None
        self.meter.add("checkpoint", time.perf_counter() - started)  # the time training waited
        return path or self.store.folder / name

    def wait_for_checkpoint(self) -> Path | None:
        """Collective: wait for the checkpoint in flight; its path (rank 0)."""
        written = self.store.wait()
        self._checkpoint_written(written)
        return written[0] if written else None

    def _checkpoint_written(self, written: tuple[Path, float] | None) -> None:
        if written is not None:
            path, seconds = written
            self._record_progress(
                end_step=self._saving_step, checkpoint=path.name,
                checkpoint_seconds=max(self.progress["checkpoint_seconds"], seconds),
            )  # fmt: skip

    def resume(self) -> None:
        """Load the newest valid checkpoint of this config, if any (rank 0 decides)."""
        heartbeat.beat("checkpoint")
        found: list[Any] = [None]
        if self.ctx.is_main:
            found[0] = self.store.latest(self.config_hash)
        dist.broadcast_object_list(found, src=0)
        latest: sharded_checkpoint.Found | None = found[0]
        snapshot = latest and latest.state
        self._record_progress(
            resumed_from=latest and latest.path.name,
            start_step=snapshot and snapshot["epoch"] * self.steps_per_epoch + snapshot["step"],
            world_size=self.ctx.world_size, strategy=self.spec.launch.strategy,
        )  # fmt: skip
        if latest is None or snapshot is None:
            torch.manual_seed(rng.rank_seed(self.recipe.seed, 0, self.ctx.rank))
            return
        if latest.legacy:  # a run started before sharded checkpoints
            if self.sharded:
                raise checkpoint.CheckpointError(
                    f"{latest.path} is a whole-model checkpoint of a run started before sharded "
                    "checkpoints: resume it once with launch.strategy: ddp (its next checkpoint "
                    "is sharded; fsdp continues from that)"
                )
            self.epoch, self.step, self.history = checkpoint.restore(snapshot, self._parts())
        else:
            tensors = sharded_checkpoint.tensors_of(self.model, self.optimizer)
            self.store.load(latest.path, tensors)
            sharded_checkpoint.restore_tensors(self.model, self.optimizer, tensors)
            self.scheduler.load_state_dict(snapshot["scheduler"])
            self.epoch, self.step = snapshot["epoch"], snapshot["step"]
            self.history = snapshot["history"]
        if len(snapshot["rng"]) == self.ctx.world_size:
            rng.restore(snapshot["rng"][self.ctx.rank], self.ctx.device)
        else:
            log.warning("world size changed since the checkpoint: dropout streams are reseeded")
            torch.manual_seed(rng.rank_seed(self.recipe.seed, self.epoch, self.ctx.rank))
        if self.ctx.is_main:
            log.info("resumed at epoch %d step %d", self.epoch, self.step)

    def _record_progress(self, **changes: Any) -> None:
        """(Rank 0) This slot's progress for its attempt record
        (:mod:`ddppipe.runstate.attempts`)."""
        if not self.ctx.is_main:
            return
        if "start_step" in changes:
            changes["start_step"] = changes["start_step"] or 0
            changes["end_step"] = changes["start_step"]
        self.progress.update(changes)
        attempts.write_progress(self.paths.state, self.progress)

    def _write_live_metrics(self) -> None:
        jsonl.write(self.paths.state.metrics, self.history)

    # -- loop ----------------------------------------------------------------------------
    def _stop_requested(self, guard: preemption.Guard) -> bool:
        """Collective: whether any rank got the stop signal; raise NonFiniteLoss when any
        rank's loss was non-finite since the last check (the earliest such step)."""
        flag = torch.tensor([1 if guard.requested() else 0, 0, guard.received or 0],
                            device=self.ctx.device)  # fmt: skip
        flag[1] = -self._first_nonfinite  # MAX of the negated index: the earliest step
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        stop, first, signum = flag.tolist()
        self._raise_if_nonfinite(-first)
        # The signal that stopped the run, on every rank: it may have reached only one of them.
        self._stop_signal = signum
        return bool(stop)

    def _raise_if_nonfinite(self, first: int) -> None:
        if first != ALL_FINITE:
            raise failures.NonFiniteLoss(first + 1, first // self.steps_per_epoch + 1)

    def _check_finite(self, step: int, loss: torch.Tensor) -> None:
        """Note step ``step`` (this epoch's) as the first non-finite one if its loss is (and
        none was before): on the device, no sync."""
        at = torch.where(torch.isfinite(loss), ALL_FINITE, self.epoch * self.steps_per_epoch + step)
        torch.minimum(self._first_nonfinite, at, out=self._first_nonfinite)

    def _forward_backward(self, batch: batches.Batch, global_count: int) -> torch.Tensor:
        y = batch[1]
        loss = evaluate.loss_of(self.net, batch, self.loss_fn, self.dtype, self.memory_format)
        # DDP and FSDP average gradients over ranks; weighting each rank's mean by its share of the
        # global batch makes the result the mean over the global batch whatever the shares.
        (loss * (y.shape[0] * self.ctx.world_size / global_count)).backward()
        return loss.detach()

    def _train_step(self, batch: batches.Batch, global_count: int) -> torch.Tensor:
        loss = self._forward_backward(batch, global_count)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return loss * batch[1].shape[0]

    def _probe_communication(self, batch: batches.Batch, global_count: int) -> float:
        """Collective: the all-reduce time a step exposes, into the meter
        (:func:`ddppipe.training.probes.communication`); returns the probe's seconds."""
        exposed, seconds = probes.communication(
            self.net, self.optimizer, lambda: self._forward_backward(batch, global_count),
            self.ctx.device,
        )  # fmt: skip
        self.meter.communication(exposed, global_count)
        return seconds

    def _run_epoch(self, guard: preemption.Guard) -> float | None:
        """Train the rest of the current epoch; return its seconds, or None when stopped."""
        n, batch = len(self.train_data), self.recipe.batch_size
        self.net.train()
        loss_total = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        show = self.ctx.is_main and sys.stderr.isatty()
        bar = tqdm(total=self.steps_per_epoch, initial=self.step, desc=f"epoch {self.epoch + 1}",
                   disable=not show, leave=False)  # fmt: skip
        batches = self.train_data.epoch(
            self.recipe.seed, self.epoch, batch, self.ctx.rank, self.ctx.world_size,
            self.step,
        )  # fmt: skip
        clock = efficiency.Clock(self.ctx.device)  # CUDA events on a GPU
        start, first, probe_s = clock.mark(), self.step, 0.0
        images = local_images = 0  # global and this rank's, this epoch in this slot
        tracked = (0.0, 0)  # loss_total and local_images at the last tracked point
        warm_at, warm_images = (start, 0) if self.meter.steps >= efficiency.WARMUP_STEPS else (
            None, 0
        )  # fmt: skip
        self.meter.training_started()
        for step, (local, global_count) in enumerate(self.meter.fed(batches), start=first):
            if step % SIGNAL_CHECK_EVERY == 0 and step > first:
                if self.tracker is not None:  # the mean loss since the last point
                    total, at = float(loss_total), self.epoch * self.steps_per_epoch + step
                    loss = (total - tracked[0]) / (local_images - tracked[1])
                    lr = self.scheduler.get_last_lr()[0]
                    self._track(at, {"loss": loss, "lr": lr}, "train")
                    tracked = (total, local_images)
                if self._stop_requested(guard):
                    self.step = step
                    bar.close()
                    self._account(clock, images, start, warm_at, warm_images, probe_s)
                    return None
            failures.at_step(self.epoch * self.steps_per_epoch + step + 1, self.epoch + 1)
            heartbeat.beat(heartbeat.STEP, self.epoch * self.steps_per_epoch + step)
            step_loss = self._train_step(local, global_count)
            self._check_finite(step, step_loss)
            images += global_count
            self.meter.steps += 1
            if warm_at is None and self.meter.steps == efficiency.WARMUP_STEPS:
                warm_at, warm_images = clock.mark(), images
                # (DDP's: its time counts as neither warm-up nor steady)
                if self.ctx.world_size > 1 and not self.sharded:
                    probe_s = self._probe_communication(local, global_count)
                    self.meter.add("communication_probe", probe_s)
            loss_total += step_loss
            local_images += local[1].shape[0]
            bar.update()
        bar.close()
        seconds = self._account(clock, images, start, warm_at, warm_images, probe_s)
        dist.all_reduce(loss_total)
        self._epoch_images = n - first * batch
        self._epoch_loss = float(loss_total) / self._epoch_images
        if not math.isfinite(self._epoch_loss):  # every rank sees it: agree on the first step
            dist.all_reduce(self._first_nonfinite, op=dist.ReduceOp.MIN)
            self._raise_if_nonfinite(int(self._first_nonfinite))
        return seconds

    def _account(
        self, clock: efficiency.Clock, images: int, start: efficiency.Mark,
        warm_at: efficiency.Mark | None, warm_images: int, probe_s: float,
    ) -> float:  # fmt: skip
        """This epoch's share of the slot's training time, warm-up apart and the all-reduce
        probe (after the warm-up) left out; its seconds."""
        end = clock.mark()
        seconds = clock.seconds(start, end) - probe_s
        if warm_at is None:  # the slot's warm-up did not end in this epoch
            warm_at, warm_images = end, images
        self.meter.trained(images, seconds, warm_images, clock.seconds(start, warm_at))
        return seconds

    def _evaluate(self) -> evaluate.Counts:
        heartbeat.beat("evaluate")
        size = self.recipe.eval_batch_size
        batches = self.test_data.shard(self.ctx.rank, self.ctx.world_size, size)
        extra = 0  # FSDP's forward is collective: every rank runs as many
        if self.sharded:
            counts = [evaluate.batch_count(len(self.test_data), r, self.ctx.world_size, size)
                      for r in range(self.ctx.world_size)]  # fmt: skip
            extra = max(counts) - counts[self.ctx.rank]
        result = evaluate.counts(
            self.model, batches, self.dtype, self.memory_format, self.eval_loss_fn,
            self.metrics_fn, extra_forwards=extra,
        )  # fmt: skip
        return result.all_reduce()

    def run(self, guard: preemption.Guard) -> None:
        """Resume, train to the last epoch, write the outputs; raise Preempted on a signal.

        ``guard`` was installed when the process started, so a signal that arrives while it
        loads data, joins the group or resumes stops it at its first step check.
        """
        self.resume()
        try:
            self._train_epochs(guard)
        except failures.NonFiniteLoss:
            # every rank stops here together: the checkpoint still being written in the
            # background is completed (committed), the one the next slot could resume from
            self._checkpoint_written(self.store.wait())
            raise

    def _train_epochs(self, guard: preemption.Guard) -> None:
        while self.epoch < self.recipe.epochs:
            train_seconds = self._run_epoch(guard)
            if train_seconds is None:
                self._stop(guard, self.save_checkpoint(wait=True))
            eval_start = time.perf_counter()
            counts = self._final_eval = self._evaluate()
            eval_seconds = time.perf_counter() - eval_start
            self.meter.add("evaluate", eval_seconds)
            self.epoch, self.step = self.epoch + 1, 0
            test = counts.summary()
            self.history.append(
                {
                    "epoch": self.epoch,
                    "train_loss": self._epoch_loss,
                    **{k: v for k, v in test.items() if isinstance(v, float)},
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
                record = self.history[-1]
                tracked = {k: v for k, v in record.items()
                           if k.startswith("test_") and isinstance(v, float)}  # fmt: skip
                tracked.update(train_loss=record["train_loss"],
                               images_per_s=record["images_per_s"])  # fmt: skip
                self._track(self.epoch * self.steps_per_epoch, tracked, "epoch")
            last = self.epoch == self.recipe.epochs
            pruned = self._prune(decide=not last)
            stop = not last and not pruned and self._stop_requested(guard)
            if last or stop or pruned or self.epoch % self.recipe.checkpoint_every == 0:
                path = self.save_checkpoint(wait=last or stop or pruned)
            if stop:
                self._stop(guard, path)
            if pruned:  # ends as a completed run: this epoch's evaluation is the final one
                self.pruned_at = self.epoch
                break
        self.wait_for_checkpoint()
        if self._final_eval is None:  # resumed after the last epoch's checkpoint
            self._final_eval = self._evaluate()
        self._record_efficiency()
        self._write_outputs()  # a signal now is noted and changes nothing: the run completes
        if self.tracker is not None:
            self.tracker.close()

    def _prune(self, decide: bool) -> bool:
        """Collective for a trial that prunes (else False at once): rank 0 reports the epoch's
        metric to the sweep's study and, with ``decide``, asks whether to stop here; every rank
        gets its answer (or raises PruningError with rank 0's message)."""
        if not self.prunes:
            return False
        answer: list[Any] = [False]
        if self.pruner is not None:
            try:
                answer[0] = self.pruner.report(self.history[-1], decide)
            except Exception as e:  # the others must not wait for a decision that never comes
                answer[0] = f"{type(e).__name__}: {e}"
        dist.broadcast_object_list(answer, src=0)
        if isinstance(answer[0], str):
            raise pruning.PruningError(f"rank 0 could not report to the sweep's study: {answer[0]}")
        return bool(answer[0])

    def _stop(self, guard: preemption.Guard, path: Path | None) -> None:
        """After the checkpoint: leave the launcher a note (rank 0), then raise Preempted."""
        signum = guard.received or self._stop_signal
        self._record_efficiency()
        if self.tracker is not None:
            self.tracker.close()
        if self.ctx.is_main:
            if guard.received_at is not None:  # signal to checkpoint written: what a stop takes
                self._record_progress(stop_seconds=time.monotonic() - guard.received_at)
            preemption.record(self.paths.state, signum, str(path))
        raise preemption.Preempted(signum, str(path))

    def _write_outputs(self) -> None:
        """Collective: rank 0 writes; every rank raises CheckpointError if it could not."""
        heartbeat.beat("checkpoint")
        snapshot = self.snapshot()

        evaluation = {
            **self._final_eval.summary(),  # type: ignore[union-attr]
            "precision": str(self.dtype).removeprefix("torch."),
            "epochs": self.epoch,
            "config_hash": self.config_hash,
        }
        if self.pruned_at is not None:
            evaluation[pruning.PRUNED_AT] = self.pruned_at

        def write() -> None:
            files.write_outputs(self.paths, snapshot, self.history, evaluation)
            if self.pruner is not None:  # after the outputs: the study counts a finished trial
                self.pruner.finish(self.history[-1], pruned=self.pruned_at is not None)

        checkpoint.rank0_writes(write)


def train(spec: run_spec.RunSpec, paths: files.Paths, guard: preemption.Guard) -> None:
    """Join the process group and train; every launched process calls this."""
    heap.keep_freed_memory()
    # (above every allowance of the hang watchdog: it names a hang before torch aborts it)
    ctx = distributed.setup(
        spec.device, allowances.collective_timeout_s(spec.launch.hang_timeout_s)
    )
    try:
        Trainer(spec, paths, ctx).run(guard)
    except BaseException as e:
        failures.record(e)  # first: its time orders it before the others' follow-on errors
        distributed.teardown(synchronize=False)  # the others may never get to a barrier
        raise
    distributed.teardown()
