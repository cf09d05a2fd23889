"""``ddppipe warm-server``: the warm server (:mod:`ddppipe.launching.warm`) with what a rank
imports before its first step, named here, where every layer may be imported."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import NoReturn

from ddppipe.launching import warm


def preload() -> tuple[ModuleType, ...]:
    """Import what the first requests need (a run's config check builds the task's model):
    torch; the server listens after it."""
    import torch
    import torch.distributed

    return torch, torch.distributed


def preload_ahead() -> tuple[ModuleType, ...]:
    """Import the rest of what a rank imports before its first step (the rest is small):
    DDP's modules (DDP's constructor imports torch._dynamo, ~1.3 s), ddppipe's training,
    evaluation and rank entry points; while the first requests run."""
    import torch._dynamo
    import torch.nn.parallel

    from ddppipe.cli import ranks
    from ddppipe.training.loop import evaluate, train

    return torch.nn.parallel, torch._dynamo, train, evaluate, ranks


def preload_later() -> tuple[ModuleType, ...]:
    """Import what the commands after a training import (matplotlib, ~0.4 s): once the server
    listens and no request waits, off the path to the first rank."""
    from ddppipe.reports import plots

    return (plots,)


def warm_server(socket: Path, data_json: str, keep_s: float, caller: int | None) -> NoReturn:
    """``ddppipe warm-server``: fork warm ranks on ``socket`` until SIGTERM; then exit at once,
    without the interpreter's finalization (with torch's modules loaded, seconds that the end
    of every Snakemake call waited for), its socket removed and its ranks ended already."""
    warm.serve(socket, preload, data=json.loads(data_json), ahead=preload_ahead,
               later=preload_later, keep_s=keep_s, caller=caller)  # fmt: skip
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
