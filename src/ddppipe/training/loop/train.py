"""The data-parallel training loop of any task: sharded batches, checkpoints, evaluation.

The task (:mod:`ddppipe.tasks`) gives the model, the datasets and optionally the loss,
metrics and optimizer; everything else is here: device, mixed precision, the sharded and
resumable data order, stop on signal, evaluation, metrics and tracking. How the ranks hold the
model (DDP, FSDP or HSDP: ``launch.strategy``) is its strategy's
(:mod:`ddppipe.training.loop.strategy`); its asynchronous checkpoints are
:mod:`ddppipe.training.loop.run_checkpoints`'s.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from ddppipe import tasks
from ddppipe.core import heap, process_times, system
from ddppipe.data import batches, sharding, staging
from ddppipe.parallel import devices, distributed, node_check, precision
from ddppipe.runstate import attempts, failures, origin, preemption
from ddppipe.settings import run_spec
from ddppipe.tasks import kept_datasets
from ddppipe.training.checkpoints import checkpoint
from ddppipe.training.loop import (
    agreement,
    determinism,
    evaluate,
    files,
    graphs,
    host_reads,
    optim,
    probes,
    pruning,
    run_checkpoints,
    stepping,
    strategy,
)
from ddppipe.training.measuring import allowances, efficiency, heartbeat, world_checks

log = logging.getLogger(__name__)

# The train loss and learning rate tracked at a check (every agreement.CHECK_EVERY steps) a
# second after the last point at the earliest. Each point wakes the tracker's writer thread,
# which takes the GIL and a CPU from the step's threads: at a 0.65 ms step a point every 10
# steps (150 a second) made the training thread lose its CPU ~380 times a second and the step
# 0.9 ms instead of 0.64 with 2 threads a rank.
TRACK_EVERY_S = 1.0


class Trainer:
    """One rank's training run."""

    def __init__(
        self, spec: run_spec.RunSpec, paths: files.Paths, ctx: distributed.Context,
        held: contextlib.ExitStack,
    ) -> None:  # fmt: skip
        self.spec, self.paths, self.ctx = spec, paths, ctx
        self.recipe = spec.train
        self.meter = efficiency.SlotMeter()
        self.progress: dict[str, Any] = {"checkpoint_seconds": 0.0}
        self.tracker: Any = None  # (rank 0's: TensorBoard, MLflow, W&B, continued across slots)
        self.task = tasks.load(spec.task, step="train (ddppipe train)")
        cuda = self._check_device()
        args = self._stage_data(run_spec.plain(spec.task_args), held)  # a plain dict
        self._load_data(args)
        process_times.mark("data")
        heartbeat.beat("start-up")
        self._build_model(args, cuda)
        self.checkpoints = run_checkpoints.Checkpoints(
            self.spec, paths.state, ctx, self.strategy,
            checkpoint.Trainable(self.model, self.optimizer, self.scheduler),
            config_hash=self.config_hash, steps_per_epoch=self.steps_per_epoch,
            record=self._record_progress, precision=self.decided, costs=self.meter.saves,
        )  # fmt: skip
        self.history: list[dict[str, Any]] = []
        self.epoch, self.step = 0, 0
        self._final_eval: evaluate.Counts | None = None
        self.agreement = agreement.Agreement(ctx.device, self.steps_per_epoch, ctx.world_size)
        if ctx.is_main:
            from ddppipe.training.tracking import run_tracking

            self.tracker = run_tracking.of_run(spec, paths.state, self.config_hash)
        # A sweep's trial with pruning on: rank 0 reports to the sweep's study at epoch ends.
        trial = spec.trial if spec.trial is not None and spec.trial.prune is not None else None
        self.prunes = trial is not None
        self.pruner = pruning.of_trial(trial) if trial is not None and ctx.is_main else None
        self.pruned_at: int | None = None  # the epoch whose end pruned the run
        process_times.mark("model")

    # -- start-up ------------------------------------------------------------------------
    def _stage_data(self, args: dict[str, Any], held: contextlib.ExitStack) -> dict[str, Any]:
        """The data folder (copied to node-local disk first with ``launch.stage_data``) and
        the config hash of this data; the task's ``args``, reading a packed folder's image
        (mounted until ``held`` closes: :func:`staging.for_rank`)."""
        stage = self.spec.launch.stage_data
        heartbeat.beat("data")  # (the phases each have their own allowance: launching.watchdog)
        with self.meter.phase("stage" if stage else "data"):
            self.data_dir, found, args = staging.for_rank(
                self.paths.data_dir, stage, args, held, lambda: heartbeat.beat("data")
            )
        self.config_hash = self.spec.train_hash(found["digest"])
        return args

    def _check_device(self) -> bool:
        """Collective: the precision the ranks' devices decide (:mod:`.precision`), the spec's
        from now on; its numerics on this rank's device, checked; whether it is a GPU."""
        ctx, self.decided = self.ctx, precision.for_world(self.recipe.precision, self.ctx.device)
        self.spec = precision.applied(self.spec, self.decided)
        self.recipe, chosen = self.spec.train, self.decided.trained
        self.dtype, self.memory_format = evaluate.numerics(chosen, self.recipe.channels_last)
        if cuda := ctx.device.type == "cuda":
            devices.check_gpu(ctx.device.index, chosen)
            self.meter.watch_gpu(ctx.device)
        if world_checks.wanted():  # the world's, before data and model: a bad one fails first
            self._record_progress(peak=world_checks.in_slot(ctx, chosen, self.meter))
        return cuda

    def _load_data(self, args: dict[str, Any]) -> None:
        """The task's train and test sets, fed to this rank."""
        spec, ctx = self.spec, self.ctx
        with self.meter.phase("data"):
            # (kept by the warm server that forked this rank, when it loaded the same data)
            train_set, test_set = kept_datasets.datasets(self.task, self.data_dir, args)
            cpus, threads = system.available_cpus(), torch.get_num_threads()
            bound = functools.partial(allowances.loader_wait_s, spec.launch.hang_timeout_s)
            # Each loader's workers forked now, kept for the slot: before the model, the
            # trackers and any checkpoint's thread (ddppipe.data.loader)
            self.train_data, self.test_data = (batches.Feed(
                part, ctx.device, batches.loader_workers(
                    spec.launch.loader_workers, part, cpus, ctx.local_world_size, threads),
                seeded=self.recipe.deterministic, wait_bound=bound,
            ).start() for part in (train_set, test_set))  # fmt: skip
        if len(self.test_data) < ctx.world_size:
            raise tasks.TaskError(
                f"task {spec.task}: {len(self.test_data)} test samples for {ctx.world_size} "
                "ranks; every rank evaluates a share: use a larger test set or fewer processes"
            )
        self.steps_per_epoch = sharding.steps_per_epoch(len(self.train_data), spec.train.batch_size)
        self.micro = sharding.micro_steps(spec.world_size, ctx.world_size)  # (a smaller world)

    def _build_model(self, args: dict[str, Any], cuda: bool) -> None:
        """The task's model, wrapped by the strategy; its losses, optimizer and schedule."""
        ctx, recipe = self.ctx, self.recipe
        torch.manual_seed(recipe.seed)  # identical initial weights on every rank
        model = self.task.call("model", args).to(ctx.device, memory_format=self.memory_format)
        self.model = model
        if cuda:
            devices.speed_up_cuda()
        if recipe.deterministic:  # (after speed_up_cuda: no cuDNN benchmark)
            determinism.enable()
        self.loss_fn = evaluate.training_loss(self.task, recipe.label_smoothing)
        self.strategy = strategy.of(self.spec.launch)
        if ctx.is_main:  # on the whole model: before FSDP shards it (its forward is collective)
            self.meter.flops_per_image = probes.flops_per_image(
                model, self.train_data.dataset, ctx.device, self.loss_fn, self.dtype,
                self.memory_format,
            )  # fmt: skip
        # What trains: the FSDP-sharded model itself, or its DDP wrapper.
        self.net = self.strategy.wrap(model, ctx.device, self.dtype == torch.bfloat16,
                                      recipe.activation_checkpointing)  # fmt: skip
        self.eval_loss_fn = self.task.module.loss if self.task.has("loss") else None
        self.metrics_fn = self.task.module.metrics if self.task.has("metrics") else None
        if self.task.has("optimizer"):
            self.optimizer = self.task.call("optimizer", self.net.parameters(), args)
        else:
            self.optimizer = self.strategy.optimizer(self.net.parameters(), recipe, ctx.device)
        self.scheduler = optim.make_scheduler(self.optimizer, recipe, self.steps_per_epoch)
        self.train_step: stepping.Stepper | graphs.GraphedStepper = stepping.Stepper(
            self.net, self.optimizer, self.scheduler, self.loss_fn, self.dtype,
            self.memory_format, ctx.world_size,
        )  # fmt: skip
        self._graph_steps()
        self.meter.watch_memory(ctx.device, model, self.optimizer)

    def _graph_steps(self) -> None:
        """``train.cuda_graphs``: :func:`graphs.decide`'s decision, logged and in the attempt
        record; the steps as a CUDA graph where it captures (a fall-back later: recorded)."""
        ctx, recipe = self.ctx, self.recipe
        rows = recipe.batch_size // self.spec.world_size  # a full batch on this rank
        facts = graphs.facts_of(
            self.optimizer, self.scheduler, ctx.device, ctx.world_size,
            self.spec.launch.strategy, self.micro, recipe.activation_checkpointing,
            tail=(len(self.train_data) % recipe.batch_size) // ctx.world_size,
        )  # fmt: skip
        decision = graphs.decide(recipe.cuda_graphs, facts)
        if ctx.is_main:
            log.info("cuda graphs: %s (%s)", "on" if decision.capture else "off",
                     decision.reason)  # fmt: skip
        self._record_progress(cuda_graphs=decision.as_dict())
        if decision.capture:
            self.train_step = graphs.GraphedStepper(
                self.train_step, facts, decision, rows,
                lambda d: self._record_progress(cuda_graphs=d.as_dict()),
            )  # fmt: skip

    def _record_efficiency(self) -> None:
        """Collective: the slot's figures into rank 0's progress (its attempt record)."""
        figures = self.meter.collect(self.ctx.world_size)
        self._record_progress(efficiency=figures)
        if self.tracker is not None:
            self.tracker.summary({"efficiency": figures})

    def _track(self, step: int, values: dict[str, float], prefix: str = "") -> None:
        if self.tracker is not None:
            self.tracker.log(step, values, prefix)

    # -- checkpoints ---------------------------------------------------------------------
    def _position(self) -> run_checkpoints.Position:
        return run_checkpoints.Position(self.epoch, self.step, self.history)

    def save_checkpoint(self, wait: bool = False, timed: bool = False) -> Path | None:
        """Collective: save a checkpoint in the background (``wait``: until it is committed;
        ``timed``: due by time) (:meth:`run_checkpoints.Checkpoints.save`: what it costs)."""
        heartbeat.beat("checkpoint")
        self.strategy.settle(self.model)
        return self.checkpoints.save(self._position(), wait, timed)

    def resume(self) -> None:
        """Collective: continue from the newest valid checkpoint of this config, if any."""
        heartbeat.beat("checkpoint")
        at = self.checkpoints.resume()
        if at is not None:
            self.epoch, self.step, self.history = at.epoch, at.step, at.history

    def _record_progress(self, **changes: Any) -> None:
        """(Rank 0) This slot's progress for its attempt record (runstate.attempts)."""
        if not self.ctx.is_main:
            return
        if "start_step" in changes:
            changes["start_step"] = changes["start_step"] or 0
            changes["end_step"] = changes["start_step"]
        self.progress.update(changes)
        attempts.write_progress(self.paths.state, self.progress)
        if self.tracker is not None and "checkpoint" in changes:  # committed: W&B may have it
            self.tracker.checkpointed(changes["end_step"])

    # -- loop ----------------------------------------------------------------------------
    def _probe_communication(self, share: batches.Share) -> float:
        """Collective: the all-reduce time a step exposes, into the meter, where the strategy
        probes it (:meth:`strategy.Strategy.probe_communication`); the probe's seconds."""
        if self.ctx.world_size == 1:
            return 0.0
        probed = self.strategy.probe_communication(
            self.net, self.optimizer, lambda: self.train_step.forward_backward(share),
            self.ctx.device,
        )  # fmt: skip
        if probed is None:
            return 0.0
        exposed, seconds = probed
        self.meter.communication(exposed, share.total)
        self.meter.add("communication_probe", seconds)
        return seconds

    def _run_epoch(self, guard: preemption.Guard) -> float | None:
        """Train the rest of the current epoch; return its seconds, or None when stopped."""
        n, batch = len(self.train_data), self.recipe.batch_size
        self.net.train()
        show = self.ctx.is_main and sys.stderr.isatty()
        bar = tqdm(total=self.steps_per_epoch, initial=self.step, desc=f"epoch {self.epoch + 1}",
                   disable=not show, leave=False)  # fmt: skip
        batches = self.train_data.epoch(self.recipe.seed, self.epoch, batch, self.ctx.rank,
                                        self.ctx.world_size, self.step, self.micro)  # fmt: skip
        clock = efficiency.Clock(self.ctx.device)  # CUDA events on a GPU
        start, first, aside_s = clock.mark(), self.step, 0.0  # (aside: not training)
        blocked = self.meter.saves.blocked_s  # (checkpoints' blocking: not training either)
        images = local_images = 0  # global and this rank's, this epoch in this slot
        base = self.epoch * self.steps_per_epoch  # the global index of the epoch's step 0
        self.agreement.start_epoch(base + first)
        # (rank 0) the loss sum read as the agreement reads, and the last tracked point's
        losses = host_reads.HostReads[tuple[int, int]](self.agreement.lag)
        tracked = (0.0, 0)  # the loss sum and local_images at the last tracked point
        next_point = 0.0  # (time.monotonic) the check that may track the next one
        warm = self.meter.steps >= efficiency.WARMUP_STEPS
        warm_at, warm_images = (start if warm else None), 0
        heartbeat.beat(heartbeat.EPOCH_START)  # (until its first batch: its own allowance)
        self.meter.training_started()
        for step, share in enumerate(self.meter.fed(batches), start=first):
            if step % agreement.CHECK_EVERY == 0 and step > first:
                agreed = self.agreement.check(guard, self.checkpoints.due())
                if self.tracker is not None and (now := time.monotonic()) >= next_point:
                    # the mean loss between two points, TRACK_EVERY_S apart at least
                    next_point = now + TRACK_EVERY_S
                    read = losses.exchange(self.agreement.loss_sum, (base + step, local_images))
                    if read is not None and read[1][1] > tracked[1]:
                        ([total], (at, seen)), lr = read, self.scheduler.get_last_lr()[0]
                        loss = (total - tracked[0]) / (seen - tracked[1])
                        self._track(at, {"loss": loss, "lr": lr}, "train")
                        tracked = (total, seen)
                if agreed.stop:
                    self.step = step
                    bar.close()
                    self._account(clock, images, start, warm_at, warm_images,
                                  aside_s + self.meter.saves.blocked_s - blocked)  # fmt: skip
                    return None
                if agreed.save:  # due by time (train.checkpoint_minutes): here, mid-epoch
                    self.step = step
                    self.save_checkpoint(timed=True)
            failures.at_step(base + step + 1, self.epoch + 1)
            heartbeat.beat(heartbeat.STEP, base + step)
            self.agreement.note(self.train_step(share), share.count)
            images += share.total
            self.meter.stepped()
            if warm_at is None and self.meter.steps == efficiency.WARMUP_STEPS:
                warm_at, warm_images = clock.mark(), images
                aside_s += self._probe_communication(share)  # (neither warm-up nor steady)
            local_images += share.count
            bar.update()
        bar.close()
        seconds = self._account(clock, images, start, warm_at, warm_images,
                                aside_s + self.meter.saves.blocked_s - blocked)  # fmt: skip
        self._epoch_images = n - first * batch
        # (collective; raises NonFiniteLoss on every rank at the earliest non-finite step)
        self._epoch_loss = self.agreement.epoch_loss_sum() / self._epoch_images
        return seconds

    def _account(
        self, clock: efficiency.Clock, images: int, start: efficiency.Mark,
        warm_at: efficiency.Mark | None, warm_images: int, aside_s: float,
    ) -> float:  # fmt: skip
        """This epoch's share of the slot's training time, warm-up apart, ``aside_s`` (the
        all-reduce probe after the warm-up, what checkpoints blocked: those by time, a step's
        wait for a copy) left out; its seconds."""
        end = clock.mark()
        seconds = clock.seconds(start, end) - aside_s
        if warm_at is None:  # the slot's warm-up did not end in this epoch
            warm_at, warm_images = end, images
        self.meter.trained(images, seconds, warm_images, clock.seconds(start, warm_at))
        return seconds

    def _evaluate(self) -> evaluate.Counts:
        heartbeat.beat("evaluate")
        self.strategy.settle(self.model)
        size = self.recipe.eval_batch_size
        batches = self.test_data.shard(self.ctx.rank, self.ctx.world_size, size)
        extra = self.strategy.eval_padding(len(self.test_data), self.ctx.rank,
                                           self.ctx.world_size, size)  # fmt: skip
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
        if self.tracker is not None:  # (its writer's import and file before the clock)
            self.tracker.open(self.epoch * self.steps_per_epoch + self.step)
        process_times.mark("resumed")
        try:
            self._train_epochs(guard)
        except failures.NonFiniteLoss:
            # every rank stops here together: the checkpoint still being written in the
            # background is completed (committed), the one the next slot could resume from
            self.checkpoints.wait()
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
            stop = not last and not pruned and self.agreement.stop_requested(guard)
            if last or stop or pruned or self.epoch % self.recipe.checkpoint_every == 0:
                path = self.save_checkpoint(wait=last or stop or pruned)
            if stop:
                self._stop(guard, path)
            if pruned:  # ends as a completed run: this epoch's evaluation is the final one
                self.pruned_at = self.epoch
                break
        self.checkpoints.wait()
        if self._final_eval is None:  # resumed after the last epoch's checkpoint
            self._final_eval = self._evaluate()
        self._record_efficiency()
        self._write_outputs()  # a signal now is noted and changes nothing: the run completes
        if self.tracker is not None:
            self.tracker.close()

    def _prune(self, decide: bool) -> bool:
        """Collective for a trial that prunes (else False at once): whether the sweep's study
        prunes it at this epoch's end (:func:`pruning.agreed`)."""
        return self.prunes and pruning.agreed(self.pruner, self.history[-1], decide)

    def _stop(self, guard: preemption.Guard, path: Path | None) -> None:
        """After the checkpoint: leave the launcher a note (rank 0), then raise Preempted."""
        signum = guard.received or self.agreement.signal
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
        self.strategy.settle(self.model)
        snapshot = self.checkpoints.snapshot(self._position())
        evaluation = {**self._final_eval.summary(),  # type: ignore[union-attr]
                      "precision": str(self.dtype).removeprefix("torch."), "epochs": self.epoch,
                      "config_hash": self.config_hash}  # fmt: skip
        if self.pruned_at is not None:
            evaluation[pruning.PRUNED_AT] = self.pruned_at

        def write() -> None:
            files.write_outputs(self.paths, snapshot, self.history, evaluation)
            if self.pruner is not None:  # after the outputs: the study counts a finished trial
                self.pruner.finish(self.history[-1], pruned=self.pruned_at is not None)

        checkpoint.rank0_writes(write)
        if self.tracker is not None and self.tracker.summarises:  # (rank 0) W&B's
            began = origin.started([vars(a) for a in attempts.load(self.paths.state)])
            git = began[1]["git"] if began else system.git_commit()  # as the provenance's
            provenance = {"git": git, **checkpoint.record(snapshot)}
            self.tracker.summary({"outcome": evaluation, "provenance": provenance})
            self.tracker.model(self.paths.weights)


def train(spec: run_spec.RunSpec, paths: files.Paths, guard: preemption.Guard) -> None:
    """Join the process group and train; every launched process calls this."""
    heap.keep_freed_memory()
    if spec.train.deterministic:  # before CUDA starts: cuBLAS reads its workspace setting
        determinism.enable()
    # (above every allowance of the hang watchdog: it names a hang before torch aborts it)
    timeout_s = allowances.collective_timeout_s(spec.launch.hang_timeout_s, spec.launch.nnodes)
    if world_checks.wanted():  # its node's own checks first: a GPU it cannot use never joins
        node_check.before_joining(spec.device, spec.train.precision, timeout_s)
    ctx = distributed.setup(spec.device, timeout_s)
    try:
        with contextlib.ExitStack() as held:  # a packed data folder's mount, until the end
            Trainer(spec, paths, ctx, held).run(guard)
    except BaseException as e:
        error = determinism.explained(e)  # an op without a deterministic kernel, named
        failures.record(error)  # first: its time orders it before the others' follow-on errors
        distributed.teardown(synchronize=False)  # the others may never get to a barrier
        if error is not e:
            raise error from e
        raise
    distributed.teardown()
