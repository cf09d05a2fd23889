"""A rank's memory: its host and GPU peaks and what its model and optimizer hold of them.

Each rank measures itself (:func:`measure`) when its slot's figures are collected
(:meth:`ddppipe.training.measuring.efficiency.SlotMeter.collect`); the slot keeps the fullest
rank's (:func:`fullest`), named by rank and node, in its attempt record. The parts are the
rank's own tensors: with sharding (FSDP's DTensor parameters) its shards (``to_local()``).
Gradients count one per trainable parameter, as large as it (DDP's buckets hold them between
steps; a ``zero_grad(set_to_none=True)`` after the step would otherwise hide them); the rest of
the peak is activations and everything else (the CUDA context is outside torch's count; on a
CPU, the host peak also holds torch's libraries and the data).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable
from typing import Any

from ddppipe.core import memory

PARTS = ("parameters", "gradients", "optimizer")


def tensor_bytes(tensor: Any) -> int:
    """The bytes of ``tensor`` on this rank: a DTensor's local shard."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def parts(parameters: Iterable[Any], optimizer: Any) -> dict[str, int]:
    """Bytes of this rank's ``parameters``, their gradients and ``optimizer``'s state."""
    import torch

    seen: set[int] = set()
    params = grads = 0
    for p in parameters:
        if id(p) in seen:
            continue
        seen.add(id(p))
        params += tensor_bytes(p)
        if p.grad is not None:
            grads += tensor_bytes(p.grad)
        elif p.requires_grad:
            grads += tensor_bytes(p)
    state = 0
    if optimizer is not None:
        for values in optimizer.state.values():
            state += sum(tensor_bytes(v) for v in values.values() if torch.is_tensor(v))
    return {"parameters": params, "gradients": grads, "optimizer": state}


def measure(device: Any, model: Any = None, optimizer: Any = None) -> dict[str, Any]:
    """This rank's memory: host peak (``ru_maxrss``), on a GPU the peak allocated and
    reserved and the device's size, and (given ``model``) the parts, in bytes."""
    figures: dict[str, Any] = {
        "rank": int(os.environ.get("RANK", "0")), "node": socket.gethostname(),
        "host_peak": memory.host_peak_bytes(),
    }  # fmt: skip
    if device.type == "cuda":
        import torch

        figures.update(
            gpu_peak=torch.cuda.max_memory_allocated(device),
            gpu_reserved=torch.cuda.max_memory_reserved(device),
            gpu_total=torch.cuda.get_device_properties(device).total_memory,
        )
    if model is not None:
        figures.update(parts(model.parameters(), optimizer))
    return figures


def fullest(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The slot's memory record from every rank's :func:`measure`: the highest host peak and
    its rank and node; on GPUs the highest GPU peak, its rank, node, reserved memory and
    device size; and the parts of the rank with the higher (GPU, else host) peak."""
    host = max(ranks, key=lambda r: r["host_peak"])
    record: dict[str, Any] = {
        "host_peak": host["host_peak"], "host_rank": host["rank"], "host_node": host["node"],
    }  # fmt: skip
    named = host
    on_gpu = [r for r in ranks if "gpu_peak" in r]
    if on_gpu:
        gpu = named = max(on_gpu, key=lambda r: r["gpu_peak"])
        record.update(gpu_peak=gpu["gpu_peak"], gpu_reserved=gpu["gpu_reserved"],
                      gpu_total=gpu["gpu_total"], gpu_rank=gpu["rank"],
                      gpu_node=gpu["node"])  # fmt: skip
    record.update({part: named[part] for part in PARTS if part in named})
    return record
