"""How the ranks hold one model (``launch.strategy``): each rank a whole replica (DDP,
:class:`Replicated`), or a shard of it (FSDP2 and hybrid FSDP2, :class:`Sharded`).

The training loop asks its strategy, and never which one it has, how to wrap the model, build
its optimizer, save and load its tensors (a sharded checkpoint's, either way, copied off the
training thread where the strategy allows), export its full weights, resume from a whole-model
checkpoint, probe its all-reduce and keep the ranks' evaluation forwards in step.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddppipe.parallel import fsdp, wrapping
from ddppipe.settings import run_spec
from ddppipe.training.checkpoints import background_copy, checkpoint, sharded_checkpoint
from ddppipe.training.loop import evaluate, optim, probes

History = list[dict[str, Any]]
log = logging.getLogger(__name__)


class Strategy(abc.ABC):
    """What differs between the strategies; what does not (the checkpoint's tensors) is here."""

    sharded = False  # the parameters are FSDP2's shards

    def __init__(self, launch: run_spec.Launch) -> None:
        self.launch = launch

    def wrap(self, model: nn.Module, device: torch.device, bf16: bool,
             activation_checkpointing: bool,
             broadcast_buffers: bool = True) -> nn.Module:  # fmt: skip
        """Collective: what trains ``model`` (on ``device``) (:func:`wrapping.wrap`)."""
        launch = self.launch
        return wrapping.wrap(
            model, device, launch.strategy, launch.nnodes, launch.nproc_per_node, bf16=bf16,
            activation_checkpointing=activation_checkpointing,
            broadcast_buffers=broadcast_buffers,
        )  # fmt: skip

    def settle(self, model: nn.Module) -> None:
        """Collective: the ranks' copies of what a training forward changes made one before
        they are read (evaluation, a checkpoint); nothing where they are one already."""
        return None

    def optimizer(
        self, params: Any, recipe: run_spec.Train, device: torch.device
    ) -> torch.optim.Optimizer:
        """The recipe's optimizer, with the kernels these parameters take."""
        return optim.make_optimizer(params, recipe, device, self.sharded)

    def tensors(self, parts: checkpoint.Trainable) -> dict[str, Any]:
        """Collective: model and optimizer state as a sharded checkpoint saves and loads it."""
        return sharded_checkpoint.tensors_of(parts.model, parts.optimizer)

    def load(self, parts: checkpoint.Trainable, tensors: dict[str, Any]) -> None:
        """Load :meth:`tensors` (filled from a checkpoint) into the training."""
        sharded_checkpoint.restore_tensors(parts.model, parts.optimizer, tensors)

    def copier(
        self, parts: checkpoint.Trainable, device: torch.device, waited: Callable[[float], None]
    ) -> background_copy.BackgroundCopy | None:
        """What copies a checkpoint's tensors off the training thread, its optimizer's next
        step waiting for it (``waited``: told how long), or None: DCP copies them on it."""
        return None

    @abc.abstractmethod
    def export(self, parts: checkpoint.Trainable) -> tuple[dict[str, Any], dict[str, Any]]:
        """Collective: full weights and optimizer state on the CPU (complete on rank 0)."""

    @abc.abstractmethod
    def resume_whole(
        self, path: Path, snapshot: dict[str, Any], parts: checkpoint.Trainable
    ) -> tuple[int, int, History]:
        """Load a whole-model checkpoint file (of a run started before sharded ones); its
        (epoch, step, history)."""

    @abc.abstractmethod
    def probe_communication(
        self, net: nn.Module, optimizer: torch.optim.Optimizer,
        forward_backward: Callable[[], Any], device: torch.device,
    ) -> tuple[float, float] | None:  # fmt: skip
        """Collective: the all-reduce seconds a step exposes and the probe's own seconds
        (:func:`probes.communication`), or None where nothing is probed."""

    @abc.abstractmethod
    def eval_padding(self, test_size: int, rank: int, world_size: int, batch_size: int) -> int:
        """The uncounted forwards this rank runs after its evaluation batches."""


class Replicated(Strategy):
    """DDP: every rank holds the whole model and all-reduces its gradients. At one rank, the
    model itself: no wrapper, no hooks around each step; the same checkpoints (the model's
    state, never the wrapper's), resumed at any world size.

    A model whose only buffers are running statistics (BatchNorm's) has them sent from rank 0
    where they are read (:meth:`settle`), not before every forward as DDP does by default:
    rank 0's evolve the same either way (updated by its own batches), and every rank
    evaluates and checkpoints rank 0's."""

    _settle = False  # the buffers are rank 0's only after settle()

    def wrap(self, model: nn.Module, device: torch.device, bf16: bool,
             activation_checkpointing: bool,
             broadcast_buffers: bool = True) -> nn.Module:  # fmt: skip
        if torch.distributed.get_world_size() == 1:
            log.info("one rank: the model trains as it is (no DistributedDataParallel)")
            if activation_checkpointing:
                fsdp.checkpoint_activations(model)
            return model
        self._settle = wrapping.running_statistics_only(model)
        return super().wrap(model, device, bf16, activation_checkpointing,
                            broadcast_buffers=not self._settle)  # fmt: skip

    def settle(self, model: nn.Module) -> None:
        if self._settle:
            for buffer in model.buffers():
                torch.distributed.broadcast(buffer, 0)

    def copier(
        self, parts: checkpoint.Trainable, device: torch.device, waited: Callable[[float], None]
    ) -> background_copy.BackgroundCopy | None:
        # whole tensors, and a torch optimizer whose step can wait (a task's may be another)
        if not background_copy.can_gate(parts.optimizer):
            return None
        return background_copy.BackgroundCopy(parts.optimizer, device, waited)

    def export(self, parts: checkpoint.Trainable) -> tuple[dict[str, Any], dict[str, Any]]:
        # (on the CPU: a checkpoint loads on any machine, without map_location)
        return (checkpoint.on_cpu(parts.model.state_dict()),
                checkpoint.on_cpu(parts.optimizer.state_dict()))  # fmt: skip

    def resume_whole(
        self, path: Path, snapshot: dict[str, Any], parts: checkpoint.Trainable
    ) -> tuple[int, int, History]:
        return checkpoint.restore(snapshot, parts)

    def probe_communication(
        self, net: nn.Module, optimizer: torch.optim.Optimizer,
        forward_backward: Callable[[], Any], device: torch.device,
    ) -> tuple[float, float] | None:  # fmt: skip
        return probes.communication(net, optimizer, forward_backward, device)  # type: ignore[arg-type]

    def eval_padding(self, test_size: int, rank: int, world_size: int, batch_size: int) -> int:
        return 0  # each rank's forwards are its own


class Sharded(Strategy):
    """FSDP2 (``fsdp``, ``hsdp``): every rank holds its shards; its forward is collective."""

    sharded = True

    def export(self, parts: checkpoint.Trainable) -> tuple[dict[str, Any], dict[str, Any]]:
        return sharded_checkpoint.full_state_dicts(parts.model, parts.optimizer)

    def resume_whole(
        self, path: Path, snapshot: dict[str, Any], parts: checkpoint.Trainable
    ) -> tuple[int, int, History]:
        raise checkpoint.CheckpointError(
            f"{path} is a whole-model checkpoint of a run started before sharded "
            "checkpoints: resume it once with launch.strategy: ddp (its next checkpoint "
            "is sharded; fsdp continues from that)"
        )

    def probe_communication(
        self, net: nn.Module, optimizer: torch.optim.Optimizer,
        forward_backward: Callable[[], Any], device: torch.device,
    ) -> tuple[float, float] | None:  # fmt: skip
        return None  # (its gradients reduce-scatter block by block: no one all-reduce)

    def eval_padding(self, test_size: int, rank: int, world_size: int, batch_size: int) -> int:
        counts = [evaluate.batch_count(test_size, r, world_size, batch_size)
                  for r in range(world_size)]  # fmt: skip
        return max(counts) - counts[rank]  # as many forwards as the rank with the most


def of(launch: run_spec.Launch) -> Strategy:
    """The strategy ``launch.strategy`` names."""
    return Sharded(launch) if launch.strategy in fsdp.SHARDED else Replicated(launch)
