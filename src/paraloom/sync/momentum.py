"""Momentum factor masking (Lin et al., Deep Gradient Compression, 2018).

An element that a replica just sent has left its residual; the momentum the optimizer keeps for
it would go on pushing the same (now stale) direction into the residual for many steps. Zeroing
that momentum where a message moved an element stops the push: the element starts again from
its fresh gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from paraloom.sync.encoding import fill_at_flat_, per_tensor

__all__ = ["MOMENTUM_STATE_KEYS", "has_momentum", "mask_momentum_"]

MOMENTUM_STATE_KEYS = ("momentum_buffer",)
"""Optimizer state entries that hold a momentum (SGD's and RMSprop's ``momentum_buffer``)."""


def has_momentum(optimizer: torch.optim.Optimizer) -> bool:
    """Whether any parameter of ``optimizer`` has a momentum buffer to mask."""
    return any(isinstance(state.get(key), Tensor)
               for state in optimizer.state.values() for key in MOMENTUM_STATE_KEYS)


def mask_momentum_(optimizer: torch.optim.Optimizer, params: list[nn.Parameter],
                   bounds: Tensor, index: Tensor) -> int:
    """Zero the momentum of the elements at ``index`` of the parameters laid end to end.

    ``bounds`` holds the cumulative element counts of ``params`` (``bounds[i]`` is where
    parameter ``i + 1`` starts); ``index`` is ascending. Returns the elements zeroed.
    """
    zeroed = 0
    for p, _, flat in per_tensor(index, params, bounds):
        state = optimizer.state.get(p, {})
        for key in MOMENTUM_STATE_KEYS:
            buffer = state.get(key)
            if isinstance(buffer, Tensor):
                fill_at_flat_(buffer, flat, 0.0)
                zeroed += flat.numel()
    return zeroed
