"""Data: the MNIST download and IDX files, the data manifest, sharded batches.

``ddppipe.data.Tensors`` is part of the task API (in-memory datasets); it loads torch only
when a task asks for it.
"""

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "Tensors":
        from ddppipe.data.batches import Tensors

        return Tensors
    raise AttributeError(f"module 'ddppipe.data' has no attribute {name!r}")
