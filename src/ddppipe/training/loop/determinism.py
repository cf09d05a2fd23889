"""``train.deterministic: true``: deterministic kernels, or an error naming the op that has none.

torch's deterministic algorithms, cuBLAS's fixed workspace (``CUBLAS_WORKSPACE_CONFIG``, read
when cuBLAS starts: set before the first GPU matmul), cuDNN's deterministic convolutions without
its benchmark's choice, and DataLoader workers seeded from the run's seed
(:class:`ddppipe.data.batches.Feed`). Off by default: on CPUs the default run is repeatable already
(docs/reproducibility.md); on GPUs it costs speed.
"""

from __future__ import annotations

import os
import re

import torch

from ddppipe.core.errors import UserError

CUBLAS_WORKSPACE = ":4096:8"
# torch's message: "<op> does not have a deterministic implementation, but you set ..."
_NO_KERNEL = re.compile(r"^(\S+) does not have a deterministic implementation", re.M)


class NoDeterministicKernel(RuntimeError, UserError):
    """An op the model uses has no deterministic kernel on this device."""


def enable() -> None:
    """Deterministic kernels from here on (every rank, before the model is built)."""
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def explained(error: BaseException) -> BaseException:
    """``error`` as :class:`NoDeterministicKernel` naming the op when torch refused one; else
    ``error`` itself."""
    found = _NO_KERNEL.search(str(error)) if isinstance(error, RuntimeError) else None
    if found is None:
        return error
    return NoDeterministicKernel(
        f"train.deterministic: the op {found[1]} has no deterministic kernel on this device; "
        "set train.deterministic: false (the run is then not bitwise repeatable on GPUs), or "
        f"replace that op in the model (torch: {str(error).splitlines()[0]})"
    )
