"""Gates and gated models for deterministic concurrency tests (imported by test modules)."""

from __future__ import annotations

import threading

import torch
from torch import nn

WAIT = 30.0  # seconds: a gate that is never opened fails the test instead of hanging it


class Gate:
    """Holds forward passes until opened; survives deepcopy so replicas share it."""

    def __init__(self, holds: int = 1) -> None:
        self.entered = threading.Event()   # set when a held forward pass has started
        self.opened = threading.Event()
        self._holds = holds
        self._lock = threading.Lock()

    def __deepcopy__(self, memo: dict) -> Gate:
        return self

    def pass_through(self) -> None:
        """Called by the model: the first ``holds`` calls wait until the gate is opened."""
        with self._lock:
            hold = self._holds > 0
            self._holds -= hold
        if hold:
            self.entered.set()
            assert self.opened.wait(WAIT), "the test never opened the gate"

    def open(self) -> None:
        self.opened.set()

    # ``with pool, gate:`` opens the gate before the pool closes, even when the test fails.
    def __enter__(self) -> Gate:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.open()


class GatedScale(nn.Module):
    """y = x * scale, after the gate: lets a test hold the worker in a forward pass."""

    def __init__(self, gate: Gate, scale: float = 2.0) -> None:
        super().__init__()
        self.gate = gate
        self.scale = nn.Parameter(torch.tensor(scale))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.gate.pass_through()
        return x * self.scale
