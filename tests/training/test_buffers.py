"""Non-persistent buffers: found beside state_dict(), sent and loaded with it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from paraloom.training.buffers import (
    load_model_state,
    load_transient,
    transient_buffers,
    with_transient,
)


class _Cached(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("mask", torch.ones(3), persistent=False)
        self.inner = nn.Module()
        self.inner.register_buffer("cache", torch.zeros(2, 2), persistent=False)


def test_transient_buffers_are_those_state_dict_leaves_out() -> None:
    model = _Cached()
    assert sorted(transient_buffers(model)) == ["inner.cache", "mask"]
    state = with_transient(model, model.state_dict())
    assert sorted(state) == ["inner.cache", "linear.bias", "linear.weight", "mask", "steps"]


def test_a_state_with_transient_buffers_loads_strictly_and_keeps_what_it_lacks() -> None:
    source, target = _Cached(), _Cached()
    with torch.no_grad():
        source.mask.fill_(0.5)
        source.inner.cache = torch.ones(4, 2)  # grown, as a rotary cache grows with the length
        source.steps += 3
    load_model_state(target, with_transient(source, source.state_dict()))
    assert torch.equal(target.mask, source.mask) and target.inner.cache.shape == (4, 2)
    assert int(target.steps) == 3 and torch.equal(target.linear.weight, source.linear.weight)
    assert "cache" in target.inner._buffers  # still a buffer, not a plain attribute
    load_model_state(target, source.state_dict())  # without them: they keep their values
    assert torch.equal(target.mask, torch.full((3,), 0.5))
    load_transient(target, {"unknown": torch.zeros(1)})  # names it does not have: skipped
    with pytest.raises(RuntimeError, match="Missing key"):
        load_model_state(target, {"mask": torch.ones(3)})  # the persistent part is strict


class _History(nn.Module):
    """A persistent buffer that forward extends: its shape changes as it trains."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2)
        self.register_buffer("seen", torch.zeros(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.seen = torch.cat([self.seen, x.detach().mean().reshape(1)])
        return self.linear(x)


def test_a_buffer_whose_shape_training_changed_comes_back_with_it() -> None:
    from paraloom import ParallelWrapper

    target = _History()
    state = {**target.state_dict(), "seen": torch.arange(4.0)}
    load_model_state(target, state)
    assert torch.equal(target.seen, torch.arange(4.0)) and "seen" in target._buffers
    with pytest.raises(RuntimeError, match="size mismatch for linear.weight"):
        load_model_state(target, {**state, "linear.weight": torch.zeros(3, 3)})
    model = _History()
    batches = [(torch.randn(4, 3), torch.randint(0, 2, (4,))) for _ in range(6)]
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), workers=2, progress=False,
                         training_mode="allreduce",
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) as wrapper:
        wrapper.fit(batches)
    assert model.seen.shape == (3,)  # rank 0's: one entry per round it trained


def test_a_resized_buffer_keeps_the_models_dtype() -> None:
    target = _History()
    load_model_state(target, {**target.state_dict(),
                              "seen": torch.arange(3.0, dtype=torch.bfloat16)})
    assert target.seen.dtype == torch.float32 and target.seen.tolist() == [0.0, 1.0, 2.0]
