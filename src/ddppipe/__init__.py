"""ddppipe: reproducible PyTorch DDP training from a laptop to a multi-node SLURM cluster."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("ddppipe")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"
