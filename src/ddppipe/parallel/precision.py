"""The precision a run trains in, decided where its ranks start.

``train.precision: auto`` (the ``fast`` preset's on CPUs) is bf16 where every rank's device
multiplies bfloat16 natively (CPUs: AVX512-BF16, AMX-BF16 or Arm BF16; GPUs: compute
capability 8.0 or newer), else fp32. The devices that train decide, once for the whole world
(bf16 only if all of them compute it natively: the slowest rank sets every step's pace), never
the machine that resolved the config: a config's identity (its hash) says ``auto`` on every
machine, and each slot's attempt record and the provenance say what it trained in.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddppipe.core import system
from ddppipe.parallel import devices
from ddppipe.settings import presets
from ddppipe.settings.run_spec import RunSpec

log = logging.getLogger(__name__)

AUTO = presets.AUTO
WHY = "no AVX512-BF16, AMX-BF16 or Arm BF16 on a CPU, compute capability below 8.0 on a GPU"


@dataclass(frozen=True)
class Decision:
    """What a slot trains in: ``configured`` (fp32, bf16 or auto) decided into ``trained``
    (fp32 or bf16); ``emulating``: the hosts whose device only emulates bfloat16."""

    configured: str
    trained: str
    emulating: tuple[str, ...] = ()

    @property
    def bf16_native(self) -> bool:
        """Whether every rank's device multiplies bfloat16 natively."""
        return not self.emulating

    def as_dict(self) -> dict[str, Any]:
        """The record's form (the attempt's ``precision``, the provenance's)."""
        return {"configured": self.configured, "trained": self.trained,
                "bf16_native": self.bf16_native, "emulating": list(self.emulating)}  # fmt: skip

    def line(self) -> str:
        """The decision in words, for rank 0's log."""
        emulated = (f"bfloat16 is only emulated on {', '.join(self.emulating)} ({WHY}), "
                    "several times slower than fp32")  # fmt: skip
        if self.configured == AUTO and self.emulating:
            return (f"train.precision auto: {self.trained}, as {emulated}; set "
                    "train.precision: bf16 to train in it anyway")  # fmt: skip
        if self.configured == AUTO:
            return f"train.precision auto: {self.trained}, as every rank computes bfloat16 natively"
        if self.trained == "bf16" and self.emulating:
            return (f"train.precision bf16, but {emulated}: set train.precision: fp32, or auto "
                    "(bf16 only where every rank computes it natively)")  # fmt: skip
        return f"train.precision {self.trained}"


def decide(configured: str, emulating: Iterable[str]) -> Decision:
    """The world's decision from the hosts whose device only emulates bfloat16 (none: every
    rank computes it natively); a precision other than ``auto`` is kept as configured."""
    hosts = tuple(sorted(set(emulating)))
    if configured != AUTO:
        return Decision(configured, configured, hosts)
    return Decision(configured, "fp32" if hosts else "bf16", hosts)


def native_bf16(device: Any, cpuinfo: Path | None = None) -> bool:
    """Whether ``device`` (a torch device) multiplies bfloat16 natively: a GPU of compute
    capability 8.0 or newer, a CPU whose ``cpuinfo`` (None: this machine's) lists a bf16 flag
    (:func:`ddppipe.core.system.cpu_computes_bf16`)."""
    if getattr(device, "type", "cpu") == "cuda":
        import torch

        return torch.cuda.get_device_capability(device) >= devices.BF16_CAPABILITY
    return system.cpu_computes_bf16(cpuinfo)


def for_world(configured: str, device: Any, cpuinfo: Path | None = None) -> Decision:
    """Collective (every rank of the process group): each rank reads its own device (and
    ``cpuinfo``); rank 0 takes the decision from what every rank found (:func:`decide`), logs
    it (a warning for bf16 that some rank only emulates) and sends it to every rank."""
    import torch.distributed as dist

    mine = None if native_bf16(device, cpuinfo) else socket.gethostname()
    main = dist.get_rank() == 0
    gathered: list[str | None] | None = [None] * dist.get_world_size() if main else None
    dist.gather_object(mine, gathered, dst=0)  # to rank 0, which decides for every rank
    decided: list[Any] = [None]
    if gathered is not None:
        decided[0] = decide(configured, (h for h in gathered if h))
        slow = decided[0].trained == "bf16" and not decided[0].bf16_native
        log.log(logging.WARNING if slow else logging.INFO, "%s", decided[0].line())
    dist.broadcast_object_list(decided, src=0)
    chosen: Decision = decided[0]
    return chosen


def applied(spec: RunSpec, decided: Decision) -> RunSpec:
    """``spec`` training in the precision ``decided`` (its identity, the config it was
    resolved from, unchanged: ``auto`` stays in its hash)."""
    return dataclasses.replace(
        spec, train=dataclasses.replace(spec.train, precision=decided.trained)
    )


def on_this_node(configured: str, device: Any, cpuinfo: Path | None = None) -> str:
    """``configured`` as this node alone decides it (fp32 or bf16): a node's own check."""
    emulating = () if native_bf16(device, cpuinfo) else (socket.gethostname(),)
    return decide(configured, emulating).trained
