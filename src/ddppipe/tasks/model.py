"""The seeds' MNIST CNN: conv 32 -> conv 64 -> max-pool -> dropout -> fc 128 -> dropout -> fc 10.

The function is the seeds' exactly; three implementation details make it faster on CPU
(measured, see README "Benchmark"): max-pooling before the second ReLU (the same function,
on a quarter of the values), a dropout drawing its mask from float32 uniforms, and a flatten
that hands its gradient back in channels_last layout so that max-pool's backward does not
convert layouts. The state dict is the seeds' one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Dropout(nn.Dropout):
    """Inverted dropout, like ``nn.Dropout``.

    On CPU it draws the mask from float32 uniforms: ``bernoulli_`` has no vectorized path for
    bfloat16 and costs ~1.5x more there. On GPUs it is ``F.dropout`` (one fused kernel).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if x.is_cuda:
            return F.dropout(x, self.p, training=True)
        keep = torch.rand_like(x, dtype=torch.float32) >= self.p
        return x * keep * (1.0 / (1.0 - self.p))


class _Flatten(torch.autograd.Function):
    """``flatten(x, 1)`` whose gradient comes back in ``x``'s memory layout (channels_last)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
        ctx.shape = x.shape
        return x.contiguous().flatten(1)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        return grad.reshape(ctx.shape).contiguous(memory_format=torch.channels_last)


def flatten(x: torch.Tensor) -> torch.Tensor:
    """``torch.flatten(x, 1)``; keeps a channels_last gradient in channels_last."""
    channels_last = not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)
    if channels_last and torch.is_grad_enabled() and x.requires_grad:
        return _Flatten.apply(x)
    return torch.flatten(x, 1)


class Net(nn.Module):
    """The seeds' CNN; ``batchnorm``: its variant with BatchNorm after each convolution (after
    the max-pool for the second) and no dropout, which trains to 99 % in one epoch (the ``gpu``
    preset, :mod:`ddppipe.settings.presets`)."""

    def __init__(self, batchnorm: bool = False) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.norm1 = nn.BatchNorm2d(32) if batchnorm else nn.Identity()
        self.norm2 = nn.BatchNorm2d(64) if batchnorm else nn.Identity()
        self.dropout1 = Dropout(0.0 if batchnorm else 0.25)
        self.dropout2 = Dropout(0.0 if batchnorm else 0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits (N, 10) for normalized images (N, 1, 28, 28)."""
        x = F.relu(self.norm1(self.conv1(x)))
        x = F.relu(self.norm2(F.max_pool2d(self.conv2(x), 2)))  # max-pool and ReLU commute
        x = self.dropout1(x)
        x = flatten(x)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return self.fc2(x)
