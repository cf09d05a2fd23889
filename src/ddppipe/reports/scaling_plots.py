"""Figures of the scaling study: learning curves per trial, throughput and efficiency."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from matplotlib.ticker import FormatStrFormatter

from ddppipe.reports.plots import plt, save
from ddppipe.reports.scaling_results import RunResult, efficiency


def label(result: RunResult) -> str:
    r = result
    cpus = "CPU" if r.cpus_per_proc == 1 else "CPUs"
    return (
        f"{r.nodes} node{'s' if r.nodes > 1 else ''} x {r.procs_per_node} proc, "
        f"{r.cpus_per_proc} {cpus}/proc (world {r.world_size})"
    )


def learning_curves(results: Sequence[RunResult], path: Path) -> None:
    """Test loss and test accuracy against epoch, one line per trial."""
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(12, 4.5))
    markers = "osD^v<>phX*"
    for i, r in enumerate(results):
        epochs = [m["epoch"] for m in r.history]
        style = {"marker": markers[i % len(markers)], "label": label(r), "alpha": 0.85}
        ax_loss.plot(epochs, [m["test_loss"] for m in r.history], **style)
        ax_acc.plot(epochs, [100 * m["test_accuracy"] for m in r.history], **style)
    ax_loss.set_ylabel("test loss (mean cross-entropy, log scale)")
    ax_loss.set_yscale("log")
    ax_loss.yaxis.set_major_formatter(FormatStrFormatter("%.3g"))
    ax_loss.yaxis.set_minor_formatter(FormatStrFormatter("%.3g"))
    ax_acc.set_ylabel("test accuracy (%)")
    last_epoch = max(m["epoch"] for r in results for m in r.history)
    for ax in (ax_loss, ax_acc):
        ax.set_xlabel("epoch")
        ax.set_xticks(range(1, last_epoch + 1))
        ax.grid(alpha=0.3)
    ax_acc.legend(fontsize=8, loc="lower right")
    fig.suptitle("Scaling study: test metrics per epoch (same global batch in every trial)")
    save(fig, path)


def throughput(results: Sequence[RunResult], path: Path) -> None:
    """Training images/s and scaling efficiency against world size, one line per CPUs/process."""
    fig, (ax_ips, ax_eff) = plt.subplots(1, 2, figsize=(12, 4.5))
    for cpus in sorted({r.cpus_per_proc for r in results}):
        group = sorted((r for r in results if r.cpus_per_proc == cpus), key=lambda r: r.world_size)
        sizes = [r.world_size for r in group]
        name = f"{cpus} CPU{'s' if cpus > 1 else ''} per process"
        ax_ips.plot(sizes, [r.images_per_s for r in group], "o-", label=name)
        effs = [(r.world_size, efficiency(r, results)) for r in group]
        effs = [(w, e) for w, e in effs if e is not None]
        if effs:
            ax_eff.plot([w for w, _ in effs], [e for _, e in effs], "o-", label=name)
    sizes = sorted({r.world_size for r in results})
    ax_eff.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="ideal (linear)")
    ax_ips.set_ylabel("training throughput (images/s, all ranks)")
    ax_eff.set_ylabel("scaling efficiency\nimages/s / (world size x images/s at world size 1)")
    ax_eff.set_ylim(bottom=0)
    for ax in (ax_ips, ax_eff):
        ax.set_xlabel("world size (training processes)")
        ax.set_xticks(sizes)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax_ips.set_ylim(bottom=0)
    fig.suptitle("Scaling study: throughput")
    save(fig, path)
