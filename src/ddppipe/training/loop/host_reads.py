"""A device tensor's values read on the host without the host waiting for the device.

Reading a GPU tensor (``.item()``, ``.tolist()``, ``float()``) waits for every kernel queued
before it: the host stops queueing the next steps, and the GPU idles until it catches up. A
:class:`HostReads` with ``lag`` 1 instead copies the tensor into pinned host memory behind the
queued kernels (an event recorded after the copy) and hands the values over at its next
exchange, when the copy is long done: the host never waits for the step it just queued. With
``lag`` 0 (a CPU, where a read costs nothing) the values are read at once.

The values are read through a NumPy view of the host copy: no tensor method on the way.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import torch

T = TypeVar("T")


def lag_for(device: torch.device) -> int:
    """The checks a decision on ``device``'s values waits: 1 on a GPU, 0 on a CPU."""
    return 1 if device.type == "cuda" else 0


def to_device(values: list[int] | list[float], dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:  # fmt: skip
    """Host ``values`` as a tensor on ``device``, the host not waiting for it: on a GPU
    through pinned memory, copied behind the queued kernels (a plain copy from pageable memory
    waits for them)."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor


class HostReads(Generic[T]):
    """The values of tensors posted one exchange after another, ``lag`` exchanges late; each
    with the ``tag`` posted beside it (what the values are of)."""

    def __init__(self, lag: int) -> None:
        if lag not in (0, 1):
            raise ValueError(f"lag {lag}: 0 (read at once) or 1 (at the next exchange)")
        self.lag = lag
        self._host: torch.Tensor | None = None
        self._view: Any = None  # (NumPy's view of it)
        self._event: Any = None
        self._posted: tuple[T] | None = None  # the tag of the copy in flight

    def exchange(self, tensor: torch.Tensor, tag: T) -> tuple[list[Any], T] | None:
        """Post ``tensor``; the values and tag of the exchange ``lag`` ago (None: none yet)."""
        if self.lag == 0:
            return tensor.reshape(-1).tolist(), tag
        previous = self.take()
        self._post(tensor, tag)
        return previous

    def take(self) -> tuple[list[Any], T] | None:
        """The values and tag of the copy in flight (waiting for it, if it is not done), and
        nothing in flight after; None when nothing was posted."""
        if self._posted is None:
            return None
        if self._event is not None:
            self._event.synchronize()  # (long done: posted an exchange ago)
        (tag,), self._posted = self._posted, None
        return self._view.reshape(-1).tolist(), tag

    def drop(self) -> None:
        """Forget the copy in flight (a new epoch's exchanges start afresh)."""
        self._posted = None

    def _post(self, tensor: torch.Tensor, tag: T) -> None:
        cuda = tensor.device.type == "cuda"
        if (
            self._host is None
            or self._host.shape != tensor.shape
            or self._host.dtype != tensor.dtype
        ):
            self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=cuda)
            self._view = self._host.numpy()
        self._host.copy_(tensor, non_blocking=cuda)
        if cuda:
            self._event = torch.cuda.Event()
            self._event.record()
        self._posted = (tag,)
