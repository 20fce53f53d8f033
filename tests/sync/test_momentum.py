"""Momentum factor masking: exactly the moved elements lose their momentum."""

from __future__ import annotations

import torch
from torch import nn

from paraloom.sync.momentum import has_momentum, mask_momentum_


def _stepped(optimizer_factory, model: nn.Module) -> torch.optim.Optimizer:
    optimizer = optimizer_factory(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    return optimizer


def test_mask_momentum_zeroes_exactly_the_given_flat_indices() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))  # 12 + 4 + 8 + 2 elements
    optimizer = _stepped(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), model)
    params = list(model.parameters())
    before = torch.cat([optimizer.state[p]["momentum_buffer"].reshape(-1) for p in params])
    assert bool((before != 0).all())
    bounds = torch.tensor([p.numel() for p in params]).cumsum(0)
    index = torch.tensor([0, 11, 12, 15, 16, 25])  # first/last of parameters 0 and 1, and more
    assert mask_momentum_(optimizer, params, bounds, index) == 6
    after = torch.cat([optimizer.state[p]["momentum_buffer"].reshape(-1) for p in params])
    expected = before.clone()
    expected[index] = 0.0
    assert torch.equal(after, expected)
    assert mask_momentum_(optimizer, params, bounds, index[:0]) == 0


def test_optimizers_without_momentum_are_left_alone() -> None:
    model = nn.Linear(3, 2)
    for factory, tensors in ((lambda p: torch.optim.SGD(p, lr=0.1), 0),
                             (lambda p: torch.optim.Adam(p), 6)):  # step, exp_avg, exp_avg_sq
        optimizer = _stepped(factory, model)
        state = {(id(p), k): v.clone() for p, s in optimizer.state.items()
                 for k, v in s.items() if isinstance(v, torch.Tensor)}
        params = list(model.parameters())
        bounds = torch.tensor([p.numel() for p in params]).cumsum(0)
        assert not has_momentum(optimizer)
        assert mask_momentum_(optimizer, params, bounds, torch.tensor([0, 7])) == 0
        after = {(id(p), k): v for p, s in optimizer.state.items()
                 for k, v in s.items() if isinstance(v, torch.Tensor)}
        assert len(state) == tensors and all(torch.equal(state[k], after[k]) for k in state)
