"""Which rows each minibatch takes: a per-epoch order fixed by (seed, epoch, rank), sliced."""

from __future__ import annotations

import numpy as np

__all__ = ["epoch_order", "batch_count", "round_batches"]


def epoch_order(n: int, seed: int, epoch: int, rank: int) -> np.ndarray:
    """This rank's row order in ``epoch``: fixed by (seed, epoch, rank), so retries repeat it."""
    return np.random.default_rng([seed, epoch, rank]).permutation(n)


def batch_count(n: int, batch_size: int) -> int:
    """Minibatches in ``n`` rows (the last one may be short)."""
    return -(-n // batch_size)


def round_batches(order: np.ndarray, batch_size: int, first: int, count: int) -> list[np.ndarray]:
    """Row indices of minibatches ``first .. first+count-1`` (fewer at the end of the rows)."""
    out = []
    for b in range(first, first + count):
        idx = order[b * batch_size:(b + 1) * batch_size]
        if not len(idx):
            break
        out.append(idx)
    return out
