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
    """Import what a rank imports before its first step (the rest is small): torch, DDP's
    modules, ddppipe's training, evaluation, rank entry points and plots."""
    import torch
    import torch._dynamo
    import torch.distributed
    import torch.nn.parallel

    from ddppipe.cli import ranks
    from ddppipe.reports import plots
    from ddppipe.training.loop import evaluate, train

    return (torch, torch.distributed, torch.nn.parallel, torch._dynamo, train, evaluate, ranks,
            plots)  # fmt: skip


def warm_server(socket: Path, data_json: str) -> NoReturn:
    """``ddppipe warm-server``: fork warm ranks on ``socket`` until SIGTERM; then exit at once,
    without the interpreter's finalization (with torch's modules loaded, seconds that the end
    of every Snakemake call waited for), its socket removed and its ranks ended already."""
    warm.serve(socket, preload, data=json.loads(data_json))
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
