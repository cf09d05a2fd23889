"""``python -m tests.host_reads_probe COUNTS ARGS...``: ``ddppipe ARGS`` in this process, every
read of a tensor's values on the host by ddppipe's own code (``item``, ``tolist``, ``float()``,
``int()``, ``bool()``: on a GPU each waits for every kernel queued before it)
counted by the training step it came in, the ranks' decisions lagged as on a GPU
(``host_reads.lag_for``); the counts into COUNTS, JSON ``{"<global step>": reads}``.

A CPU has no device to wait for, so the reads are counted where they are made: a frame of
``src/ddppipe`` the nearest outside torch (torch's own, such as an optimizer's step count kept
on the host, are not ddppipe's).
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

import torch
from torch.overrides import TorchFunctionMode

import ddppipe
from ddppipe.cli import ranks
from ddppipe.cli.main import main
from ddppipe.core import env_names
from ddppipe.runstate import failures
from ddppipe.training.loop import host_reads

READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__float__, torch.Tensor.__int__,
         torch.Tensor.__bool__, torch.Tensor.__index__}  # fmt: skip
OURS, TORCH = str(Path(ddppipe.__file__).parent), str(Path(torch.__file__).parent)


def ours(frame: FrameType | None) -> bool:
    """Whether the nearest frame outside torch (and this file) is ddppipe's."""
    while frame is not None and (frame.f_code.co_filename.startswith(TORCH)
                                 or frame.f_code.co_filename == __file__):  # fmt: skip
        frame = frame.f_back
    return frame is not None and frame.f_code.co_filename.startswith(OURS)


class Reads(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.by_step: Counter[int] = Counter()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in READS and failures._step is not None and ours(sys._getframe(1)):
            self.by_step[failures._step[0]] += 1
        return func(*args, **(kwargs or {}))


def exit_now(code: int) -> NoReturn:
    raise SystemExit(code)  # (the rank's os._exit would skip writing the counts)


if __name__ == "__main__":
    os.environ.pop(env_names.WARM_SOCKET, None)  # (trains here, not in a warm server's fork)
    host_reads.lag_for = lambda device: 1  # (as on a GPU)
    ranks._exit_now = exit_now
    reads = Reads()
    try:
        with reads:
            main(sys.argv[2:])
    finally:
        Path(sys.argv[1]).write_text(json.dumps(dict(reads.by_step)))
