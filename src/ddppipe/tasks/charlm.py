"""A byte-level language model: a decoder-only transformer over Python's own source code.

The text ships with Python (the standard library's ``.py`` files): no download. ``prepare``
writes ``charlm.pt`` into the data folder: the UTF-8 bytes of the named modules' sources, one
after another, at most ``max_bytes``. ``datasets`` cuts them into windows of ``context + 1``
bytes (each window's last byte starts the next): the model reads ``context`` bytes and predicts
each next one. The last ``test_fraction`` of the windows are the test set (no overlap with
training). The bytes depend on the Python version that prepared them (the data manifest
records their SHA-256).

The model's size is a task argument: about ``12 * layers * d_model**2`` parameters (plus
``(512 + context) * d_model``), from a few million (``d_model`` 256, ``layers`` 4: 3.4 M) to about
a billion (``d_model`` 2048, ``layers`` 20: 1.0 G). Its blocks (``Net.blocks``) are what
``launch.strategy: fsdp`` shards one by one. No dropout and no batch statistics: a sample's
loss does not depend on which rank trains it, so a run gives the same numbers at any world size.

``task_args``:

- ``modules`` (``argparse``, ``textwrap``, ``string``, ``functools``, ``inspect``): the
  standard-library modules whose sources are the text;
- ``max_bytes`` (1,000,000): at most this many bytes of it;
- ``test_fraction`` (0.1): the share of windows held out for testing;
- ``context`` (64): bytes a sample reads;
- ``d_model`` (128), ``layers`` (4), ``heads`` (4): the transformer's width, depth and heads.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ddppipe.core import atomic
from ddppipe.data.batches import Tensors

FILE = "charlm.pt"
PREPARE_ARGS = ("modules", "max_bytes")
VOCAB = 256  # bytes

ARGS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "modules": {
            "type": "array",
            "minItems": 1,
            "items": {"type": "string"},
            "default": ["argparse", "textwrap", "string", "functools", "inspect"],
        },
        "max_bytes": {"type": "integer", "minimum": 1000, "default": 1_000_000},
        "test_fraction": {
            "type": "number",
            "exclusiveMinimum": 0,
            "exclusiveMaximum": 1,
            "default": 0.1,
        },
        "context": {"type": "integer", "minimum": 2, "default": 64},
        "d_model": {"type": "integer", "minimum": 8, "default": 128},
        "layers": {"type": "integer", "minimum": 1, "default": 4},
        "heads": {"type": "integer", "minimum": 1, "default": 4},
    },
}


def _text(modules: list[str], max_bytes: int) -> bytes:
    """The modules' source files, concatenated, at most ``max_bytes``."""
    parts = []
    for name in modules:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            raise ValueError(f"task_args.modules: {name!r} is not a module with Python source")
        parts.append(Path(spec.origin).read_bytes())
    return b"\n".join(parts)[:max_bytes]


def prepare(data_dir: Path, args: dict[str, Any]) -> None:
    """Write ``charlm.pt`` (atomically; untouched when it already holds this text)."""
    text = torch.frombuffer(bytearray(_text(args["modules"], args["max_bytes"])), dtype=torch.uint8)
    dest = Path(data_dir) / FILE
    if dest.is_file():
        held = torch.load(dest, map_location="cpu", weights_only=True)
        if torch.equal(held.get("text", torch.empty(0)), text):
            return
    with atomic.atomic_path(dest) as tmp, open(tmp, "wb") as f:  # (its archive: "archive/")
        torch.save({"text": text.clone()}, f)


def as_tokens(x: torch.Tensor) -> torch.Tensor:
    """uint8 bytes -> the embedding's int64 indices."""
    return x.long()


def datasets(data_dir: Path, args: dict[str, Any]) -> tuple[Tensors, Tensors]:
    """Windows of ``context`` bytes and their next bytes, train then test, in memory."""
    path = Path(data_dir) / FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: run the task's prepare() first")
    text = torch.load(path, map_location="cpu", weights_only=True)["text"]
    context = args["context"]
    n = (text.numel() - 1) // context
    if n < 4:
        raise ValueError(f"{path}: {text.numel()} bytes make {n} windows of {context}: too few")
    windows = text[: n * context + 1]
    inputs = windows[:-1].reshape(n, context)
    targets = windows[1:].reshape(n, context).long()
    test = max(1, round(n * args["test_fraction"]))
    return (
        Tensors(inputs[:-test].clone(), targets[:-test].clone(), as_tokens),
        Tensors(inputs[-test:].clone(), targets[-test:].clone(), as_tokens),
    )


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x MLP."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"task_args: d_model {d_model} does not divide by heads {heads}")
        self.heads = heads
        self.norm1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class Net(nn.Module):
    """Byte embedding + learned positions -> ``layers`` blocks -> norm -> logits (N, T, 256)."""

    def __init__(self, context: int, d_model: int, layers: int, heads: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d_model)
        self.position = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], device=x.device)
        h = self.embed(x) + self.position(positions)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h)).clone()  # not a view: FSDP hooks the root output


def model(args: dict[str, Any]) -> nn.Module:
    return Net(args["context"], args["d_model"], args["layers"], args["heads"])


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of every next byte, the mean over the batch's bytes."""
    return F.cross_entropy(output.flatten(0, 1), target.flatten())


def metrics(output: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sums over the batch's samples of each sample's mean byte loss and accuracy."""
    per_byte = F.cross_entropy(output.transpose(1, 2), target, reduction="none")  # (N, T)
    correct = (output.argmax(-1) == target).float()
    return {"loss": per_byte.mean(1).sum(), "correct": correct.mean(1).sum()}
