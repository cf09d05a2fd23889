"""For the task files of tests: rank 0 stops itself (SIGUSR1, as SLURM signals before a time
limit) at its ``STOP_AT_FORWARD``-th training forward, when that variable is set. Task files
import it as ``tests.stopping`` (their processes run in the repository's root)."""

from __future__ import annotations

import os
import signal

import torch
from torch import nn


def stop_at_forward(net: nn.Module) -> nn.Module:
    """``net``, with a hook that sends rank 0 SIGUSR1 at its STOP_AT_FORWARD-th forward."""
    forwards = [0]

    def stop_at(module: nn.Module, inputs: object) -> None:
        if module.training and torch.is_grad_enabled() and os.environ["RANK"] == "0":
            forwards[0] += 1
            if forwards[0] == int(os.environ.get("STOP_AT_FORWARD", "0")):
                os.kill(os.getpid(), signal.SIGUSR1)

    net.register_forward_pre_hook(stop_at)
    return net
