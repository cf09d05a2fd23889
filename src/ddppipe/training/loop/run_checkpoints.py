"""A training's checkpoints as its loop takes them: each written in the background while
training goes on (:class:`ddppipe.training.checkpoints.sharded_checkpoint.Store`), its tensors
copied off the training thread where the strategy allows (DDP:
:mod:`ddppipe.training.checkpoints.background_copy`), what each cost
(:class:`ddppipe.training.measuring.save_costs.SaveCosts`), the newest resumed from, and the
final snapshot of full weights; the model's tensors as its strategy
(:mod:`ddppipe.training.loop.strategy`) holds them.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddppipe.core import jsonl
from ddppipe.data import sharding
from ddppipe.parallel import distributed
from ddppipe.parallel.precision import Decision
from ddppipe.runstate.state import StateDir
from ddppipe.settings import run_spec
from ddppipe.training.checkpoints import checkpoint, sharded_checkpoint
from ddppipe.training.loop import rng, save_clock
from ddppipe.training.loop.strategy import Strategy
from ddppipe.training.measuring import save_costs
from ddppipe.training.tracking import provenance

log = logging.getLogger(__name__)

History = list[dict[str, Any]]


@dataclass
class Position:
    """Where a training stands: ``epoch`` completed epochs, ``step`` steps into the next."""

    epoch: int
    step: int
    history: History


class Checkpoints:
    """One rank's side of its run's checkpoints: every method collective; rank 0 records the
    slot's progress (its attempt record) through ``record``."""

    def __init__(
        self, spec: run_spec.RunSpec, state: StateDir, ctx: distributed.Context,
        strategy: Strategy, parts: checkpoint.Trainable, *, config_hash: str,
        steps_per_epoch: int, record: Callable[..., None], precision: Decision,
        costs: save_costs.SaveCosts,
    ) -> None:  # fmt: skip
        self.spec, self.state, self.ctx, self.parts = spec, state, ctx, parts
        self.strategy = strategy
        self.config_hash, self.steps_per_epoch, self.record = config_hash, steps_per_epoch, record
        self.costs = costs
        # Saved in the background: their collectives have a group of their own (sharing the
        # training's can deadlock against its collectives).
        group = dist.new_group(backend="gloo")
        # (DDP: every rank's tensors the same, copied off the training thread by rank 0 alone)
        replicated = not strategy.sharded
        copier = (
            strategy.copier(parts, ctx.device, costs.gated)
            if ctx.is_main or not replicated
            else None
        )
        self.store = sharded_checkpoint.Store(state.checkpoints, spec.train.keep_checkpoints,
                                              group, copier, replicated)  # fmt: skip
        # every rank's host, to rank 0 alone: only its state and snapshot are complete
        hosts: list[str] | None = [""] * ctx.world_size if ctx.is_main else None
        dist.gather_object(socket.gethostname(), hosts, dst=0)
        self.precision = precision.as_dict()  # the ranks' (ddppipe.parallel.precision)
        self.meta = provenance.meta(spec, ctx, hosts or [], self.precision)  # checkpoints record
        self._saving_step = 0  # the global step of the checkpoint in flight
        self._recorded = ""  # the folder of the last save recorded as committed (rank 0)
        self._longest_s = 0.0  # the longest save of this slot, start to commit
        self._metrics_written = -1  # the epochs of history rank 0 last wrote to the metrics
        self.clock = save_clock.SaveClock(spec.train.checkpoint_minutes)  # (rank 0's counts)

    def due(self) -> bool:
        """Whether a checkpoint is due by time (``train.checkpoint_minutes``) on this rank's
        clock (only rank 0's counts: :meth:`ddppipe.training.loop.agreement.Agreement.check`).
        First, on rank 0, a save committed since is recorded at once (its step and folder in
        the attempt record: a slot that ends without waiting for it, a lost node or a crash,
        still says the step it kept; its costs are counted when it is waited for)."""
        written = self.store.committed()
        if written is not None and written.path.name != self._recorded:
            self._recorded = written.path.name
            self.record(end_step=self._saving_step, checkpoint=written.path.name)
        return self.clock.due()

    def snapshot(self, at: Position) -> dict[str, Any]:
        """The whole training state, full weights; only rank 0's is complete."""
        weights, optimizer = self.strategy.export(self.parts)
        states = {"model": weights, "optimizer": optimizer,
                  "scheduler": self.parts.scheduler.state_dict()}  # fmt: skip
        return checkpoint.snapshot(self.config_hash, at.epoch, at.step, states,
                                   self._rng_streams(), at.history, self.meta)  # fmt: skip

    def _rng_streams(self) -> list[Any]:
        """Every rank's RNG state, gathered on rank 0 (elsewhere an empty list)."""
        streams: list[Any] | None = [None] * self.ctx.world_size if self.ctx.is_main else None
        dist.gather_object(rng.state(self.ctx.device), streams, dst=0)
        return streams or []

    def save(self, at: Position, wait: bool = False, timed: bool = False) -> Path | None:
        """Every rank starts writing its part of a sharded checkpoint, in the background
        (``wait``: and waits until it is committed: before a stop or the end; ``timed``: due by
        time); rank 0 writes the live metrics (if the history grew). Every rank raises
        CheckpointError if any could not write. What it blocked the training thread is counted
        (:attr:`costs`)."""
        started, queued = time.perf_counter(), self.store.in_flight()
        self._written(self.store.wait())  # the previous one first: one in flight at a time
        if queued:
            self.costs.waited_for_previous(time.perf_counter() - started)
        # ("rng": how many ranks saved their streams, each rank's in a file of its own)
        state = {"config_hash": self.config_hash, "epoch": at.epoch, "step": at.step,
                 "scheduler": self.parts.scheduler.state_dict(), "rng": self.ctx.world_size,
                 "history": at.history, "meta": self.meta}  # fmt: skip
        tensors = self.strategy.tensors(self.parts) if self.store.writes_tensors else {}
        name = self.store.save(state, tensors, rng.state(self.ctx.device))
        self.clock.restart()  # the next by time counts from this one's start
        self._saving_step = at.epoch * self.steps_per_epoch + at.step
        if self.ctx.is_main and len(at.history) != self._metrics_written:  # (not mid-epoch)
            jsonl.write(self.state.metrics, at.history)
            self._metrics_written = len(at.history)
        path = self.wait() if wait else None
        self.costs.started(time.perf_counter() - started, timed)
        return path or self.store.folder / name

    def wait(self) -> Path | None:
        """Wait for the checkpoint in flight; its path (rank 0)."""
        written = self.store.wait()
        self._written(written)
        return written.path if written else None

    def _written(self, written: sharded_checkpoint.Written | None) -> None:
        if written is not None:  # (rank 0)
            self.costs.committed(written.copy_s, written.write_s)
            self._longest_s = max(self._longest_s, written.seconds)
            self.record(end_step=self._saving_step, checkpoint=written.path.name,
                        checkpoint_seconds=self._longest_s)  # fmt: skip

    def resume(self) -> Position | None:
        """Load the newest valid checkpoint of this config, if any (rank 0 decides), and this
        rank's RNG streams; where it stands (None: at the start)."""
        found: list[Any] = [None]
        if self.ctx.is_main:
            found[0] = self.store.latest(self.config_hash)
        dist.broadcast_object_list(found, src=0)
        latest: sharded_checkpoint.Found | None = found[0]
        snapshot = latest and latest.state
        world, configured = self.ctx.world_size, self.spec.world_size
        self.record(
            resumed_from=latest and latest.path.name,
            start_step=snapshot and snapshot["epoch"] * self.steps_per_epoch + snapshot["step"],
            world_size=world, strategy=self.spec.launch.strategy, precision=self.precision,
            micro_steps=sharding.micro_steps(configured, world),
        )  # fmt: skip
        kept = sharding.micro_note(configured, world, self.spec.train.batch_size)
        if kept and self.ctx.is_main:
            log.warning("a smaller world: %s", kept)
        self.clock.restart()  # training starts (again): the next by time counts from here
        seed, rank = self.spec.train.seed, self.ctx.rank
        if latest is None or snapshot is None:
            torch.manual_seed(rng.rank_seed(seed, 0, rank))
            return None
        at = self._load(latest, snapshot)
        streams = self._saved_streams(latest, snapshot["rng"])
        if streams is not None:
            rng.restore(streams, self.ctx.device)
        else:
            torch.manual_seed(rng.rank_seed(seed, at.epoch, rank))
        if self.ctx.is_main:
            log.info("resumed at epoch %d step %d", at.epoch, at.step)
        return at

    def _saved_streams(self, latest: sharded_checkpoint.Found, saved: int | list[Any]) -> Any:
        """This rank's RNG streams in the checkpoint (``saved``: how many ranks saved theirs,
        each in its own file; a list of them all in checkpoints of before), None where they do
        not fit: at another world size (every rank's streams reseeded, the ranks that no
        longer exist dropped, new ones seeded alike) or unreadable (this rank's reseeded)."""
        world, rank = self.ctx.world_size, self.ctx.rank
        count = len(saved) if isinstance(saved, list) else saved
        if count != world:
            if self.ctx.is_main:
                log.warning("world size changed since the checkpoint (%d ranks, now %d): dropout "
                            "streams are reseeded", count, world)  # fmt: skip
            return None
        if isinstance(saved, list):
            return saved[rank]
        return sharded_checkpoint.read_streams(latest.path, rank)

    def _load(self, latest: sharded_checkpoint.Found, snapshot: dict[str, Any]) -> Position:
        if latest.legacy:  # a run started before sharded checkpoints
            return Position(*self.strategy.resume_whole(latest.path, snapshot, self.parts))
        tensors = self.strategy.tensors(self.parts)
        self.store.load(latest.path, tensors)
        self.strategy.load(self.parts, tensors)
        self.parts.scheduler.load_state_dict(snapshot["scheduler"])
        return Position(snapshot["epoch"], snapshot["step"], snapshot["history"])
