"""Figures: confusion matrix and training curves (PNG, non-interactive backend)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from ddppipe import atomic


def save(fig: Any, path: Path) -> None:
    """Write a figure as PNG (atomically) and close it."""
    with atomic.atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight")
    plt.close(fig)


def confusion_matrix(matrix: Sequence[Sequence[int]], accuracy: float, path: Path) -> None:
    """Heat map of (true, predicted) counts with the counts written in the cells."""
    fig, ax = plt.subplots(figsize=(6.4, 5.6))
    image = ax.imshow(matrix, cmap="Blues", norm=matplotlib.colors.LogNorm(vmin=1))
    n = len(matrix)
    for i in range(n):
        for j in range(n):
            value = matrix[i][j]
            if value:
                color = "white" if i == j else "black"
                ax.text(j, i, str(value), ha="center", va="center", fontsize=7, color=color)
    ax.set_xticks(range(n))
    ax.set_yticks(range(n))
    ax.set_xlabel("predicted digit")
    ax.set_ylabel("true digit")
    ax.set_title(f"MNIST test set: confusion matrix (accuracy {accuracy:.2%})")
    fig.colorbar(image, ax=ax, label="images (log scale)")
    save(fig, path)


def training_curves(history: Sequence[dict[str, Any]], path: Path) -> None:
    """Train/test loss and test accuracy per epoch."""
    epochs = [m["epoch"] for m in history]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    ax_loss.plot(epochs, [m["train_loss"] for m in history], "o-", label="train")
    ax_loss.plot(epochs, [m["test_loss"] for m in history], "s-", label="test")
    ax_loss.set_xlabel("epoch")
    ax_loss.set_ylabel("cross-entropy loss")
    ax_loss.set_yscale("log")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    ax_acc.plot(epochs, [100 * m["test_accuracy"] for m in history], "o-", color="C2")
    ax_acc.set_xlabel("epoch")
    ax_acc.set_ylabel("test accuracy (%)")
    ax_acc.grid(alpha=0.3)
    for ax in (ax_loss, ax_acc):
        ax.set_xticks(epochs)
    fig.suptitle("Training curves")
    save(fig, path)
