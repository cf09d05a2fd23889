"""The ``apptainer`` program: its name, the error its steps raise, whether a config uses it."""

from __future__ import annotations

from ddppipe.core.errors import UserError
from ddppipe.settings.run_spec import Container

APPTAINER = "apptainer"


class ContainerError(RuntimeError, UserError):
    """An image could not be built or inspected; the message says which step and where to look."""


def enabled(container: Container) -> bool:
    """Whether the run trains inside an Apptainer image (``container.mode: apptainer``)."""
    return container.mode == "apptainer"
