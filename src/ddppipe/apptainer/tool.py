"""The ``apptainer`` program: its name, the error its steps raise, whether a config uses it."""

from __future__ import annotations

from typing import Any

from ddppipe.core.errors import UserError

APPTAINER = "apptainer"


class ContainerError(RuntimeError, UserError):
    """An image could not be built or inspected; the message says which step and where to look."""


def enabled(cfg: dict[str, Any]) -> bool:
    """Whether the config trains inside an Apptainer image (``container.mode: apptainer``)."""
    return cfg["container"]["mode"] == "apptainer"
