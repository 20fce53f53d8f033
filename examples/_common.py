"""What the examples share: the digits data, and how long to train (``--quick``: a few seconds,
for the test suite)."""

from __future__ import annotations

import sys

from torch.utils.data import DataLoader

from paraloom.datasets import digits

QUICK = "--quick" in sys.argv


def epochs(full: int) -> int:
    return 1 if QUICK else full


def loaders(batch_size: int = 32) -> tuple[DataLoader, DataLoader]:
    """scikit-learn's 8x8 digits: 1,438 training and 359 test images."""
    import torch

    train = DataLoader(digits("train"), batch_size=batch_size, shuffle=True,
                       generator=torch.Generator().manual_seed(0))
    return train, DataLoader(digits("test"), batch_size=256)
