"""Counting a rank's collectives of Python objects (``torch.distributed``'s ``*_object*``
functions): which ran, and how many objects this rank received, as a test checks that per-rank
metadata goes only to the rank that uses it."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist

# each function, and where its received objects are: the argument's index (None: none received)
COUNTED = {
    "all_gather_object": 0,  # (output list, obj)
    "gather_object": 1,  # (obj, output list or None, dst)
    "broadcast_object_list": 0,  # (list, src)
    "scatter_object_list": 0,  # (output list, input list or None, src)
}


@contextlib.contextmanager
def counted() -> Iterator[Counter[str]]:
    """Within: every call of :data:`COUNTED` by this process counted (``name``) with the
    objects it received (``name:received``, a received list's length; a sender's broadcast
    list counts too)."""
    calls: Counter[str] = Counter()
    originals = {name: getattr(dist, name) for name in COUNTED}

    def wrapped(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            where = COUNTED[name]
            received = args[where] if len(args) > where else None  # (ddppipe's: positional)
            calls[f"{name}:received"] += len(received or [])
            return original(*args, **kwargs)

        return call

    for name, original in originals.items():
        setattr(dist, name, wrapped(name, original))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
