"""ddppipe: reproducible PyTorch DDP training from a laptop to a multi-node SLURM cluster.

Packages, bottom to top (each imports only those below it; ``lint-imports`` checks):
``core``, ``settings``, ``data``, ``tasks``, ``runstate``, ``apptainer``, ``parallel``,
``slurm``, ``training``, ``launching``, ``reports``, ``sweeps``, ``cli``. ``ddppipe.job`` is the
API of users' torchrun scripts (``from ddppipe import job``).
"""

from importlib.metadata import PackageNotFoundError, version
from typing import Any

try:
    __version__ = version("ddppipe")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"


def __getattr__(name: str) -> Any:
    if name == "job":  # the script API, where users' scripts have always imported it
        from ddppipe.training.script import job

        return job
    raise AttributeError(f"module 'ddppipe' has no attribute {name!r}")
