"""A training step as one CUDA graph (``train.cuda_graphs``): forward, backward and the
optimizer's step captured once and replayed, one launch for a step's hundreds of kernels.

Whether a run's step is captured is :func:`decide`'s: a pure function of what is known about
the run (:class:`Facts`: device, world, strategy, optimizer, schedule; and what the eager
warm-up found), a :class:`Decision` with its reason in words. The reason is logged and put in
the slot's attempt record (``cuda_graphs``); a run that asked for graphs (``on``) and cannot
have them trains eagerly and says why.

How a graphed step runs (:class:`GraphedStepper`; PyTorch's whole-network capture,
``torch.cuda.graphs``):

- The slot's first :data:`WARMUP_STEPS` full batches train eagerly on a side stream (real
  steps, in order: lazy initialisation, cuDNN's tuning, the optimizer's state), the last of
  them watched for host synchronisations (``torch.cuda.set_sync_debug_mode``: a model that
  reads a value on the host, or whose shapes depend on its data, cannot be captured).
- The next full batch is copied into static input tensors and one step captured
  (``torch.cuda.graph``, autocast without its weight cache), then replayed: capture runs
  nothing, the replay trains that batch.
- Every later batch of that shape: copied into the static inputs, the graph replayed. A batch
  of another shape (the epoch's last, smaller batch) trains eagerly, its gradients accumulated
  into the graph's own (zeroed first, kept attached).
- The learning rate (and Adam's betas, where the schedule cycles them) are device tensors the
  graph reads, filled from the optimizer's own numbers before a replay when they changed. The
  optimizer's param groups keep plain numbers, as an eager run's: the scheduler steps them on
  the host after each replay and a checkpoint saves exactly what an eager run saves, so a run
  resumes exactly, graphed or not. Any other hyper-parameter changing after capture (a
  schedule of weight decay, ...) ends the graphs: eager from then on, said.
- The optimizer's step hooks run outside the replay, around it: the checkpoint copy's gate
  (:mod:`ddppipe.training.checkpoints.background_copy`) waits before the replay changes
  the parameters, as before an eager step.

Everything per step outside the step itself (heartbeats, the agreement's loss window and NaN
stop, checkpoints by time, goodput, hang detection, pruning) is the loop's, unchanged: the
graph's loss is a static tensor the loop copies as it copies an eager one.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from ddppipe.data import batches
from ddppipe.training.loop import evaluate, stepping

log = logging.getLogger(__name__)

WARMUP_STEPS = 3  # eager steps on a side stream before the capture (PyTorch's example: 3)
# Whether the GPU suite measured the graphed step faster and correct (what `auto` turns on):
# no GPU measurement exists yet, so `auto` is off everywhere.
MEASURED = False
# Schedules that rewrite Adam's betas (or SGD's momentum) every step when they cycle momentum.
CYCLING = ("OneCycleLR", "CyclicLR")
ADAM = ("Adam", "AdamW")
# What a schedule may change on the host between replays: read from the groups before each.
MIRRORED = ("lr", "betas")
# The schedules' own bookkeeping in the groups, and the kernel flags capture sets and restores.
NOT_HYPERPARAMETERS = frozenset({
    "params", "initial_lr", "max_lr", "min_lr", "base_momentum", "max_momentum", "capturable",
    "fused", "foreach", "param_names",
})  # fmt: skip


@dataclass(frozen=True)
class Facts:
    """What decides whether a run's step can be captured, known before its first step
    (``warm_up``: what the eager warm-up found that a capture cannot take, once it ran)."""

    device: str  # the rank's device type: cuda, cpu, ...
    world_size: int = 1
    strategy: str = "ddp"  # launch.strategy
    micro_steps: int = 1  # a rank's micro-steps a step (a world smaller than the run's)
    optimizer: str = "AdamW"  # its class's name
    torch_optimizer: bool = True  # a torch.optim.Optimizer (a task's may be anything)
    fused: bool = False  # its groups take the fused kernels
    differentiable: bool = False
    tensor_lr: bool = False  # its learning rate a tensor already (a task's optimizer)
    schedule: str = "OneCycleLR"  # the scheduler's class name
    cycles_momentum: bool = False  # it rewrites betas[0] (or momentum) on the host every step
    activation_checkpointing: bool = False
    tail: int = 0  # the samples of an epoch's last batch on this rank when it is smaller
    warm_up: str | None = None  # the warm-up's finding (a host sync, shapes that vary)


@dataclass(frozen=True)
class Decision:
    """Whether the step is captured and why; how its optimizer's step is captured."""

    configured: str  # train.cuda_graphs as set: auto, on, off
    capture: bool
    reason: str
    update: str | None = None  # the optimizer kernels captured: fused or foreach
    tensor_betas: bool = False  # Adam's betas read from device tensors (a cycling schedule)
    tail: str | None = None  # how a smaller last batch trains: eager

    def as_dict(self) -> dict[str, Any]:
        """For the attempt record: what is set (betas as tensors only when they are)."""
        return {k: v for k, v in asdict(self).items()
                if v is not None and (k != "tensor_betas" or v)}  # fmt: skip

    def fallen_back(self, reason: str) -> Decision:
        """This decision once the step could not be captured after all (``reason``)."""
        return replace(self, capture=False, reason=reason, update=None, tensor_betas=False,
                       tail=None)  # fmt: skip


def _refusal(facts: Facts) -> str | None:
    """Why ``facts`` rule a capture out, or None."""
    if facts.device != "cuda":
        return f"the step runs on {facts.device}, not a CUDA GPU: CUDA graphs are a GPU's"
    if facts.strategy != "ddp":
        return (
            f"launch.strategy {facts.strategy}: FSDP2 gathers and reduce-scatters "
            "each block's parameters with hooks and streams of its own: not captured"
        )
    if facts.world_size > 1:
        return (f"DDP at {facts.world_size} ranks: capturing its all-reduce needs NCCL's "
                "asynchronous error handling off (the collectives' timeout, which the hang "
                "detection relies on, needs it on) and DDP built on a side stream; not "
                "verified on GPUs: one rank only")  # fmt: skip
    if facts.micro_steps > 1:
        return (f"{facts.micro_steps} micro-steps a step (a world smaller than the run's): "
                "their gradients accumulate over several forwards")  # fmt: skip
    if facts.activation_checkpointing:
        return ("train.activation_checkpointing: the backward's recomputation saves and "
                "restores the RNG's state on the host; not verified under capture")  # fmt: skip
    if not facts.torch_optimizer:
        return f"the task's optimizer ({facts.optimizer}) is no torch.optim.Optimizer"
    if facts.differentiable:
        return f"{facts.optimizer}(differentiable=True): no capturable step"
    if facts.tensor_lr:
        return (f"{facts.optimizer}'s learning rate is a tensor of the task's already: ddppipe "
                "mirrors the numbers its schedule steps")  # fmt: skip
    if facts.optimizer == "SGD":
        if facts.cycles_momentum:
            return (f"SGD's momentum is a number its kernels take, and {facts.schedule} "
                    "changes it every step (cycle_momentum): a replay would keep the captured "
                    "one")  # fmt: skip
        if not facts.fused:
            return ("SGD without fused kernels: its multi-tensor step takes the learning rate "
                    "as a number on the host")  # fmt: skip
    elif facts.optimizer not in ADAM:
        return (
            f"the optimizer {facts.optimizer}: ddppipe captures Adam, AdamW (fused "
            "or not) and fused SGD, whose steps take the learning rate as a tensor"
        )
    if facts.warm_up is not None:
        return facts.warm_up
    return None


def decide(mode: str, facts: Facts, measured: bool = MEASURED) -> Decision:
    """Whether the step of a run with ``facts`` is captured, ``train.cuda_graphs`` being
    ``mode`` (auto, on or off, as the run spec has it: ddppipe.settings.run_spec.Train;
    ``measured``: the GPU suite measured the graphed step faster and correct, what ``auto``
    needs); the reason in words either way."""
    if mode == "off":
        return Decision(mode, False, "train.cuda_graphs: off")
    refused = _refusal(facts)
    if refused is not None:
        return Decision(mode, False, refused)
    tensor_betas = facts.optimizer in ADAM and facts.cycles_momentum
    # Adam's fused kernel takes betas as numbers: a schedule that cycles them needs the
    # multi-tensor step, which reads them (and the learning rate) from device tensors.
    update = "fused" if facts.fused and not tensor_betas else "foreach"
    tail = "eager" if facts.tail else None
    if mode == "auto" and not measured:
        return Decision(mode, False, "auto: no GPU measurement shows the graphed step faster "
                        f"and correct yet (it could be captured: {update} optimizer step); "
                        "train.cuda_graphs: on uses it")  # fmt: skip
    said = ["forward, backward and the optimizer's step as one CUDA graph",
            f"{facts.optimizer}'s {update} step reading the learning rate"
            + (" and betas" if tensor_betas else "") + " from device tensors"]  # fmt: skip
    if tail:
        said.append(f"an epoch's last batch ({facts.tail} samples here) eager")
    return Decision(mode, True, "; ".join(said), update, tensor_betas, tail)


def facts_of(
    optimizer: Any, scheduler: Any, device: torch.device, world_size: int, strategy: str,
    micro_steps: int, activation_checkpointing: bool, tail: int,
) -> Facts:  # fmt: skip
    """The :class:`Facts` of a run's built parts (nothing measured: attributes read)."""
    torch_optimizer = isinstance(optimizer, torch.optim.Optimizer)
    groups = optimizer.param_groups if torch_optimizer else []
    return Facts(
        device=device.type, world_size=world_size, strategy=strategy, micro_steps=micro_steps,
        optimizer=type(optimizer).__name__, torch_optimizer=torch_optimizer,
        fused=bool(groups) and all(g.get("fused") for g in groups),
        differentiable=any(g.get("differentiable") for g in groups),
        tensor_lr=any(isinstance(g.get("lr"), torch.Tensor) for g in groups),
        schedule=type(scheduler).__name__,
        cycles_momentum=type(scheduler).__name__ in CYCLING
        and bool(getattr(scheduler, "cycle_momentum", False)),
        activation_checkpointing=activation_checkpointing, tail=tail,
    )  # fmt: skip


def _hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each group's numbers a captured step took as they were (all but the mirrored ones)."""
    return [{k: v for k, v in g.items() if k not in NOT_HYPERPARAMETERS and k not in MIRRORED}
            for g in optimizer.param_groups]  # fmt: skip


def _run_hooks(optimizer: torch.optim.Optimizer, post: bool) -> None:
    """The optimizer's step hooks (global, then its own), as its ``step`` runs them."""
    from torch.optim import optimizer as torch_optimizer

    if post:
        found = [*torch_optimizer._global_optimizer_post_hooks.values(),
                 *optimizer._optimizer_step_post_hooks.values()]  # fmt: skip
    else:
        found = [*torch_optimizer._global_optimizer_pre_hooks.values(),
                 *optimizer._optimizer_step_pre_hooks.values()]  # fmt: skip
    for hook in found:
        hook(optimizer, (), {})


class GraphedStepper:
    """A :class:`stepping.Stepper`'s steps as a replayed CUDA graph (module docstring), on
    one rank: ``decision`` is :func:`decide`'s on ``facts`` (capturing); ``full``: the rows of
    a full batch on this rank; ``report(decision)``: told when the decision changes (a
    fall-back)."""

    def __init__(
        self, eager: stepping.Stepper, facts: Facts, decision: Decision, full: int,
        report: Callable[[Decision], None] = lambda decision: None,
        warmup_steps: int = WARMUP_STEPS,
    ) -> None:  # fmt: skip
        self.eager, self.facts, self.decision = eager, facts, decision
        self.full, self._report = full, report
        self.optimizer = eager.optimizer
        self.warmup_steps = warmup_steps
        self.warmed = 0  # full batches trained eagerly on the side stream so far
        self.shape: tuple[Any, ...] | None = None  # the full batches' (x, y) shapes and dtypes
        self.graph: torch.cuda.CUDAGraph | None = None
        self.replays = self.eager_steps = 0  # (after capture)
        self._static: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._grads: list[torch.Tensor | None] = []  # the graph's gradients, kept attached
        self._mirrors: list[dict[str, Any]] = []  # each group's device tensors
        self._mirrored: list[tuple[Any, ...]] = []  # the numbers last filled in
        self._taken: list[dict[str, Any]] = []  # the hyper-parameters captured
        self._side: torch.cuda.Stream | None = None  # the warm-up's stream

    # -- the step ----------------------------------------------------------------------
    def forward_backward(self, share: batches.Share) -> torch.Tensor:
        """(The all-reduce probe's: world size 1 never probes) the eager forward/backward."""
        return self.eager.forward_backward(share)

    def __call__(self, share: batches.Share) -> torch.Tensor:
        """Train one step; its batch-mean loss (a static tensor of the graph when replayed:
        read or copy it before the next step)."""
        if not self.decision.capture or share.parts:
            return self._eager_step(share)
        shape = self._shape(share)
        whole = share.count == share.total  # (a loss weighted 1: what the graph computes)
        if self.graph is not None:
            replays = shape == self.shape and whole
            return self._replay(share) if replays else self._eager_step(share)
        if share.batch[0].shape[0] != self.full or not whole:
            return self._eager_step(share)  # (a smaller batch: never warms up or captures)
        if self.shape is not None and shape != self.shape:
            self._warm_up_found(f"the full batches' shapes vary ({self.shape} then {shape}): "
                                "a graph replays one shape")  # fmt: skip
            return self._eager_step(share)
        self.shape = shape
        if self.warmed < self.warmup_steps:
            return self._warm_up(share, watch=self.warmed == self.warmup_steps - 1)
        return self._capture(share)

    @staticmethod
    def _shape(share: batches.Share) -> tuple[Any, ...]:
        x, y = share.batch
        return (tuple(x.shape), x.dtype, tuple(y.shape), y.dtype)

    def _eager_step(self, share: batches.Share) -> torch.Tensor:
        """An eager step. After the capture: the graph's gradients zeroed (not dropped: the
        graph writes them), accumulated into, stepped, kept."""
        if self.graph is None:
            return self.eager(share)
        self.eager_steps += 1
        self.optimizer.zero_grad(set_to_none=False)
        loss = self.eager.forward_backward(share)
        self.optimizer.step()
        self.eager.step_schedule()
        return loss

    def _warm_up(self, share: batches.Share, watch: bool) -> torch.Tensor:
        """An eager step on a side stream (:meth:`stepping.Stepper.__call__`'s); ``watch``:
        its forward's and backward's host synchronisations found (not its optimizer's: an
        eager step's may read its step count on the host, the captured one does not)."""
        if self._side is None:
            self._side = torch.cuda.Stream()
        side, main = self._side, torch.cuda.current_stream()
        side.wait_stream(main)
        found: list[str] = []
        with torch.cuda.stream(side):
            with _synchronisations(found, watch):
                loss = self.eager.forward_backward(share)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.eager.step_schedule()
        main.wait_stream(side)
        self.warmed += 1
        if found:
            self._warm_up_found(f"the step synchronises with the host ({found[0]}): a model "
                                "that reads a value on the host, or whose shapes depend on its "
                                "data, cannot be captured")  # fmt: skip
        return loss

    def _capture(self, share: batches.Share) -> torch.Tensor:
        """Capture the step on this (full) batch, then replay it: the batch trained."""
        _run_hooks(self.optimizer, post=False)  # (a checkpoint's copy in flight: done first)
        x, y = share.batch
        static_x, static_y = torch.empty_like(x), torch.empty_like(y)
        static_x.copy_(x)
        static_y.copy_(y)
        self.optimizer.zero_grad(set_to_none=True)  # the graph's own gradients, from its pool
        graph = torch.cuda.CUDAGraph()
        saved = self._as_captured()
        try:
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                loss = _captured_loss(self.eager, static_x, static_y)
                loss.backward()
                self.optimizer.step()
        except Exception as e:  # (any failure: eager, said)
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            self._restore(saved)
            self.optimizer.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            self._fall_back(f"the capture failed ({type(e).__name__}: {first[:300]})")
            return self._eager_step(share)
        self._restore(saved)
        self.graph, self._static = graph, (static_x, static_y, loss.detach())
        self._grads = [p.grad for g in self.optimizer.param_groups for p in g["params"]]
        self._taken = _hyperparameters(self.optimizer)
        log.info("cuda graphs: the step captured (%s)", self.decision.reason)
        return self._replay(share, copied=True)

    def _replay(self, share: batches.Share, copied: bool = False) -> torch.Tensor:
        assert self.graph is not None and self._static is not None
        if _hyperparameters(self.optimizer) != self._taken:
            self._drop_graph("a hyper-parameter other than the learning rate and betas changed "
                             "after the capture (the graph took the old value)")  # fmt: skip
            return self._eager_step(share)
        static_x, static_y, loss = self._static
        if not copied:
            x, y = share.batch
            static_x.copy_(x)
            static_y.copy_(y)
        self._fill_mirrors()
        _run_hooks(self.optimizer, post=False)
        self.graph.replay()
        _run_hooks(self.optimizer, post=True)
        self.eager.step_schedule()
        self.replays += 1
        return loss

    # -- learning rate and betas as device tensors ---------------------------------------
    def _as_captured(self) -> list[dict[str, Any]]:
        """The groups set for the capture (the flags, the mirrored numbers as device tensors
        made now); what they held, for :meth:`_restore`."""
        saved, self._mirrors, self._mirrored = [], [], []
        for group in self.optimizer.param_groups:
            device = group["params"][0].device
            saved.append({k: group[k] for k in ("lr", "betas", "capturable", "fused", "foreach")
                          if k in group})  # fmt: skip
            mirror: dict[str, Any] = {"lr": torch.tensor(float(group["lr"]), device=device)}
            if self.decision.tensor_betas:
                mirror["betas"] = tuple(torch.tensor(float(b), device=device)
                                        for b in group["betas"])  # fmt: skip
            self._mirrors.append(mirror)
            self._mirrored.append(self._numbers(group))
            group.update(mirror)
            if "capturable" in group:
                group["capturable"] = True
            if self.decision.update == "foreach" and "fused" in group:
                group["fused"], group["foreach"] = False, True
        self.optimizer._warned_capturable_if_run_uncaptured = True  # (eager steps: by design)
        return saved

    def _restore(self, saved: list[dict[str, Any]]) -> None:
        """The groups as an eager run has them (numbers, its kernels' flags)."""
        for group, was in zip(self.optimizer.param_groups, saved, strict=True):
            group.update(was)

    def _numbers(self, group: dict[str, Any]) -> tuple[Any, ...]:
        betas = tuple(group["betas"]) if self.decision.tensor_betas else ()
        return (group["lr"], *betas)

    def _fill_mirrors(self) -> None:
        """The device tensors filled from the groups' numbers where they changed (a fill
        kernel each; none in a step the schedule left them alone)."""
        for i, group in enumerate(self.optimizer.param_groups):
            numbers = self._numbers(group)
            if numbers == self._mirrored[i]:
                continue
            mirror = self._mirrors[i]
            mirror["lr"].fill_(float(group["lr"]))
            if self.decision.tensor_betas:
                for tensor, value in zip(mirror["betas"], group["betas"], strict=True):
                    tensor.fill_(float(value))
            self._mirrored[i] = numbers

    # -- falling back ------------------------------------------------------------------
    def _warm_up_found(self, finding: str) -> None:
        """The warm-up found what a capture cannot take: :func:`decide` again, told it."""
        self.facts = replace(self.facts, warm_up=finding)
        self._changed(decide(self.decision.configured, self.facts))

    def _fall_back(self, reason: str) -> None:
        self._changed(self.decision.fallen_back(reason))

    def _changed(self, decision: Decision) -> None:
        log.warning("cuda graphs: eager from now on: %s", decision.reason)
        self.decision = decision
        self._report(decision)

    def _drop_graph(self, reason: str) -> None:
        self._fall_back(reason)
        self.graph = None
        self.optimizer.zero_grad(set_to_none=True)
        self._grads, self._static = [], None


def _captured_loss(eager: stepping.Stepper, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The loss of the captured forward: :func:`evaluate.loss_of`'s, autocast without its
    weight cache (cast copies made in a capture would not be remade by a replay)."""
    dtype = eager.dtype
    with torch.autocast(x.device.type, dtype=dtype, enabled=dtype != torch.float32,
                        cache_enabled=False):  # fmt: skip
        output = eager.net(evaluate.as_input(x, eager.memory_format))
    return eager.loss_fn(output.float(), y)


@contextlib.contextmanager
def _synchronisations(found: list[str], watch: bool) -> Iterator[None]:
    """Within: each host synchronisation torch reports appended to ``found`` (``watch``;
    else nothing watched)."""
    if not watch:
        yield
        return
    before = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(before)
    found.extend(str(w.message).splitlines()[0] for w in caught
                 if "synchroniz" in str(w.message))  # fmt: skip
