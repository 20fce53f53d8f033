"""A model that fails once, in a chosen way, on one replica at a chosen step (fault injection)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from paraloom.bench.faults import inject_failure as _fail

HOWS = ("raise", "exit", "kill", "stop")


class FailOnce(nn.Module):
    """An MLP whose forward, on rank ``rank`` at its ``at``-th training call, fails as ``how``
    says: raises, exits with code 0, is SIGKILLed or SIGSTOPped. ``marker`` makes it happen
    once per test: the replica that replaces the failed one trains normally."""

    def __init__(self, marker: Path | None = None, how: str = "raise", at: int = 5,
                 rank: int = 1) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
        self.marker = None if marker is None else str(marker)
        self.how, self.at, self.rank, self.calls = how, at, rank, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.marker is not None and dist.is_initialized() \
                and dist.get_rank() == self.rank:
            self.calls += 1
            if self.calls == self.at and not os.path.exists(self.marker):
                Path(self.marker).touch()
                _fail(self.how)
        return self.net(x)


def digits_loader(rows: int = 768, batch_size: int = 32) -> DataLoader:
    """scikit-learn's digits (8x8), unshuffled: the same data order in every run."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    data = TensorDataset(torch.tensor(x[:rows] / 16.0, dtype=torch.float32).view(-1, 1, 8, 8),
                         torch.tensor(y[:rows]))
    return DataLoader(data, batch_size=batch_size)


class FailWhenArmed(FailOnce):
    """Like FailOnce, but counts only the calls made once the file ``armed`` exists: the test
    arms it between two fits on the same workers."""

    def __init__(self, marker: Path, armed: Path, how: str = "kill", at: int = 3) -> None:
        super().__init__(marker, how, at)
        self.armed = str(armed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and dist.is_initialized() and dist.get_rank() == self.rank \
                and os.path.exists(self.armed) and not os.path.exists(str(self.marker)):
            self.calls += 1
            if self.calls == self.at:
                Path(str(self.marker)).touch()
                _fail(self.how)
        return self.net(x)


def gil_holding_step(model: nn.Module, batch) -> torch.Tensor:
    """A step_fn whose first call on rank 1 spends a second in C code that keeps the GIL (the
    heartbeat thread cannot run meanwhile), as a long native call would."""
    if dist.get_rank() == 1 and not getattr(model, "_held", False):
        sum(range(30_000_000))
        model._held = True
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)
