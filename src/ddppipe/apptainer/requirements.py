"""``container.requirements``: the task's pinned packages, and the layer they name."""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from pathlib import Path

from ddppipe.apptainer.tool import ContainerError
from ddppipe.core import hashing
from ddppipe.settings.run_spec import Container

LAYER_SUFFIX = ".layer.sqfs"


@functools.cache
def _requirement_pattern() -> re.Pattern[str]:
    """A pinned requirement (``name==version``): the schema's pattern, the one definition."""
    from ddppipe.settings import config

    node = config.schema()["properties"]["container"]["properties"]["requirements"]
    return re.compile(node["items"]["pattern"])


def requirements(container: Container) -> list[str]:
    """``container.requirements``, sorted, without duplicates; ContainerError if one is unpinned."""
    return pinned(container.requirements)


def pinned(requirements: Sequence[str]) -> list[str]:
    """``requirements`` sorted, without duplicates; ContainerError if one is unpinned."""
    given = [str(r) for r in requirements]
    pinned = _requirement_pattern()
    loose = [r for r in given if not pinned.search(r)]
    if loose:
        hints = []
        for r in loose:
            name = re.split(r"[\s\[<>=!~;@(]", r.strip(), maxsplit=1)[0] or r
            hints.append(f"  {r!r}: write {name}==VERSION (`pip index versions {name}` lists them)")
        raise ContainerError(
            "container.requirements must be pinned as name==version: the task's layer is "
            "rebuilt only when the list changes, so an unpinned requirement would stay at whatever "
            "version the first build got.\n" + "\n".join(hints)
        )
    return sorted(set(given))


def requirements_hash(reqs: list[str]) -> str:
    """12 hex digits naming a task's layer: SHA-256 of the sorted requirements."""
    return hashing.sha256("\n".join(sorted(set(reqs))).encode())[:12]


def layer_path(base: str | Path, reqs: list[str]) -> Path:
    """The layer of ``reqs`` over the image ``base``, beside it: ``ddppipe.sif`` ->
    ``ddppipe-<hash>.layer.sqfs`` (its info: ``ddppipe-<hash>.layer.json``)."""
    base = Path(base)
    return base.with_name(f"{base.stem}-{requirements_hash(reqs)}{LAYER_SUFFIX}")
