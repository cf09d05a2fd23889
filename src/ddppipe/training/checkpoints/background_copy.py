"""A checkpoint's copy of a training's tensors in CPU memory, taken off the training thread
(DDP, where every rank holds whole tensors: :class:`BackgroundCopy`).

What a checkpoint saves must be the training's state at the step it names. Between two
optimizer steps only two things change the model's and optimizer's tensors: a forward in
training mode changes the model's buffers (BatchNorm's running statistics, DDP's broadcast of
rank 0's buffers), and the optimizer's step changes the parameters and its own state. So the
copy is taken in two parts: the tensors the optimizer does not own (the buffers, and anything
else it does not step: small) at once on the training thread; the parameters and the
optimizer's state by a worker thread while the next step's forward and backward run, and that
optimizer's next ``step`` (a step pre-hook: whoever calls it) waits until that copy is done.
Correct by construction: nothing the worker copies changes before the hook returns.

On a GPU the worker's copies run on a stream of their own into pinned buffers
(``non_blocking``), after an event recorded on the training's stream when the copy was asked
for (the last step's kernels done first); the worker waits for that stream, and the step's
hook waits for the worker. On a CPU the worker copies, and the step waits for it the same way.
The buffers are kept from save to save (one copy in flight at a time: a store starts the
next save only once the previous one is written).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class _Slot:
    """Where a tensor stood in a state dict (its index among the tensors)."""

    index: int


def _skeleton(state: Any, tensors: list[torch.Tensor]) -> Any:
    """``state`` with new containers and each tensor replaced by its :class:`_Slot` (appended
    to ``tensors``); other values as they are."""
    if isinstance(state, torch.Tensor):
        tensors.append(state)
        return _Slot(len(tensors) - 1)
    if isinstance(state, dict):
        return {k: _skeleton(v, tensors) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(_skeleton(v, tensors) for v in state)
    return state


def _filled(skeleton: Any, copies: list[torch.Tensor]) -> Any:
    """The state dict of ``skeleton`` with its slots' ``copies``."""
    if isinstance(skeleton, _Slot):
        return copies[skeleton.index]
    if isinstance(skeleton, dict):
        return {k: _filled(v, copies) for k, v in skeleton.items()}
    if isinstance(skeleton, list | tuple):
        return type(skeleton)(_filled(v, copies) for v in skeleton)
    return skeleton


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def stepped_by(optimizer: torch.optim.Optimizer) -> set[int]:
    """The storages that only ``optimizer``'s step changes: its parameters and its state."""
    owned = {_storage(p) for group in optimizer.param_groups for p in group["params"]}
    owned |= {_storage(v) for state in optimizer.state.values() for v in state.values()
              if isinstance(v, torch.Tensor)}  # fmt: skip
    owned.discard(0)  # (empty tensors: no storage to tell apart)
    return owned


def can_gate(optimizer: Any) -> bool:
    """Whether ``optimizer``'s step can be made to wait for a copy (a torch optimizer)."""
    return isinstance(optimizer, torch.optim.Optimizer)


class BackgroundCopy:
    """Stages state dicts for ``dcp.async_save`` (its ``async_stager``): each a copy in CPU
    buffers kept from save to save, the part ``optimizer`` steps taken by a worker thread, its
    next step waiting for it (``waited(seconds)`` told how long it blocked). One copy at a time.
    """

    _synchronize_after_execute = False  # (DCP: staging is awaited through its Future)

    def __init__(
        self, optimizer: torch.optim.Optimizer, device: torch.device,
        waited: Callable[[float], None] = lambda seconds: None,
    ) -> None:  # fmt: skip
        self._optimizer, self._waited = optimizer, waited
        self._cuda = device.type == "cuda"
        self._device = device
        self._stream = torch.cuda.Stream(device) if self._cuda else None
        self._buffers: list[torch.Tensor] = []
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-copy")
        self._copy: Future[Any] | None = None
        self.times = (0.0, 0.0)  # the last copy's start and end (time.perf_counter)
        self._hook = optimizer.register_step_pre_hook(self._gate)

    def stage(self, state_dict: dict[str, Any]) -> Future[Any]:
        """Start copying ``state_dict`` (its tensors on this rank's device or the CPU); a
        Future of the copy. The tensors the optimizer does not step are copied before this
        returns."""
        if self._copy is not None and not self._copy.done():
            raise RuntimeError("a checkpoint's copy is still in flight: wait for its save first")
        started = time.perf_counter()
        tensors: list[torch.Tensor] = []
        skeleton = _skeleton(state_dict, tensors)
        owned = stepped_by(self._optimizer)
        later = [i for i, t in enumerate(tensors) if _storage(t) in owned]
        deferred = set(later)
        for i, tensor in enumerate(tensors):  # now: what a forward may change
            if i not in deferred:
                self._buffer(i, tensor).copy_(tensor, non_blocking=self._cuda)
        taken = None
        if self._cuda:  # the training's kernels so far (the last step's, the copies above)
            taken = torch.cuda.Event()
            taken.record(torch.cuda.current_stream(self._device))
        self._copy = self._worker.submit(self._take, skeleton, tensors, later, taken, started)
        return self._copy

    @property
    def held_bytes(self) -> int:
        """The host memory its kept buffers hold (pinned on a GPU): the state it copies."""
        return sum(b.numel() * b.element_size() for b in self._buffers)

    def _buffer(self, i: int, tensor: torch.Tensor) -> torch.Tensor:
        """The kept CPU buffer of the ``i``-th tensor (allocated anew if its shape changed)."""
        while len(self._buffers) <= i:
            self._buffers.append(torch.empty(0))
        kept = self._buffers[i]
        if kept.shape != tensor.shape or kept.dtype != tensor.dtype:
            pin = self._cuda and tensor.device.type == "cuda"
            kept = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
            self._buffers[i] = kept
        return kept

    def _take(
        self, skeleton: Any, tensors: list[torch.Tensor], later: list[int],
        taken: torch.cuda.Event | None, started: float,
    ) -> Any:  # fmt: skip
        """(The worker) Copy the deferred tensors; the filled state dict."""
        if self._stream is not None and taken is not None:
            with torch.cuda.device(self._device), torch.cuda.stream(self._stream):
                self._stream.wait_event(taken)
                for i in later:
                    self._buffer(i, tensors[i]).copy_(tensors[i], non_blocking=True)
            self._stream.synchronize()  # (and so the copies made at once: after `taken`)
        else:
            for i in later:
                self._buffer(i, tensors[i]).copy_(tensors[i])
        self.times = (started, time.perf_counter())
        return _filled(skeleton, self._buffers[: len(tensors)])

    def _gate(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """(The optimizer's step pre-hook) Wait for the copy in flight, if any."""
        copy = self._copy
        if copy is None or copy.done():
            return
        started = time.perf_counter()
        wait_for([copy])  # (its failure is the save's: reported when the store waits)
        self._waited(time.perf_counter() - started)

    def synchronize_staging(self) -> None:
        """(DCP's deprecated hook) Wait for the copy in flight."""
        if self._copy is not None:
            wait_for([self._copy])

    def close(self) -> None:
        """Kept open across saves (torch's ``async_save`` may call this after each one)."""

    def shut(self) -> None:
        """Stop the worker and the step's hook (the training is over)."""
        self._hook.remove()
        self._worker.shutdown(wait=True)
