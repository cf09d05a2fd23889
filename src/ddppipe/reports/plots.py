"""Figures: evaluation (confusion matrix or metrics) and training curves (PNG, Agg backend)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from ddppipe.core import atomic


def save(fig: Any, path: Path) -> None:
    """Write a figure as PNG (atomically) and close it."""
    with atomic.atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight")
    plt.close(fig)


def evaluation(result: dict[str, Any], path: Path, title: str = "test set") -> None:
    """The confusion matrix when the task has one, else a bar chart of its test metrics."""
    if result.get("confusion_matrix") is not None:
        confusion_matrix(result["confusion_matrix"], result["test_accuracy"], path, title)
        return
    values = {k: v for k, v in result.items() if isinstance(v, float)}
    fig, ax = plt.subplots(figsize=(6.4, 0.6 + 0.4 * max(len(values), 1)))
    ax.barh(list(values), list(values.values()), color="C0")
    for i, v in enumerate(values.values()):
        ax.text(v, i, f" {v:.4g}", va="center")
    ax.set_title(f"{title}: metrics")
    save(fig, path)


def confusion_matrix(
    matrix: Sequence[Sequence[int]], accuracy: float, path: Path, title: str = "test set"
) -> None:
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
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    ax.set_title(f"{title}: confusion matrix (accuracy {accuracy:.2%})")
    fig.colorbar(image, ax=ax, label="samples (log scale)")
    save(fig, path)


# Per-epoch (or per-step) figures that are bookkeeping, not learning curves.
NOT_CURVES = frozenset({"epoch", "step", "time", "world_size", "lr", "images_per_s",
                        "epoch_seconds", "train_seconds", "test_count"})  # fmt: skip


def training_curves(history: Sequence[dict[str, Any]], path: Path) -> None:
    """Losses (left) and the other metrics (right) per epoch, or per step for a script run."""
    x_key = "epoch" if history and "epoch" in history[0] else "step"
    keys = sorted({k for m in history for k, v in m.items()
                   if k not in NOT_CURVES and isinstance(v, int | float)})  # fmt: skip
    losses = [k for k in keys if "loss" in k]
    others = [k for k in keys if k not in losses]
    fig, (ax_loss, ax_other) = plt.subplots(1, 2, figsize=(10, 4))
    for ax, group, ylabel in ((ax_loss, losses, "loss"), (ax_other, others, "metric")):
        for key in group:
            points = [(m[x_key], m[key]) for m in history if key in m]
            percent = key.endswith("accuracy")
            xs = [p[0] for p in points]
            ys = [100 * p[1] if percent else p[1] for p in points]
            style = "o-" if len(points) < 50 else "-"
            ax.plot(xs, ys, style, label=key + (" (%)" if percent else ""))
        ax.set_xlabel(x_key)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if group:
            ax.legend()
    if losses and all(m[k] > 0 for m in history for k in losses if k in m):
        ax_loss.set_yscale("log")
    fig.suptitle("Training curves")
    save(fig, path)
