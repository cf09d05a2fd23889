"""Train/test splits of a built-in task's samples: seeded, stratified, the same every time."""

from __future__ import annotations

import numpy as np


def stratified(labels: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """Sorted indices of the test set: ``round(n * fraction)`` random samples of each class of
    ``n``, at least one and at most ``n - 1`` (every class has two samples or more)."""
    rng = np.random.default_rng(seed)
    test = []
    for label in np.unique(labels):
        members = np.flatnonzero(labels == label)
        n_test = min(max(round(len(members) * fraction), 1), len(members) - 1)
        test.append(rng.permutation(members)[:n_test])
    return np.sort(np.concatenate(test))
