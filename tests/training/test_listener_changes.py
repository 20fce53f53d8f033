"""What a listener may change during a fit: what trains and the param groups (the fit stops and
says so), and what an optimizer's own state_dict hooks keep."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from paraloom import ParallelWrapper, TrainingListener


class _Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(8, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.emb(x)))


def _batches(n: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g))
            for _ in range(n)]


class _AtEpoch(TrainingListener):
    """Calls ``change`` once, as epoch ``epoch`` starts (the fit that goes on starts it too)."""

    def __init__(self, epoch: int, change: Callable[[], None]) -> None:
        self.epoch, self.change, self.done = epoch, change, False

    def on_epoch_start(self, epoch: int) -> None:
        if epoch == self.epoch and not self.done:
            self.done = True
            self.change()


@pytest.mark.parametrize(("workers", "mode"), [
    (1, "averaging"), (2, "averaging"), (2, "allreduce"), (2, "shared_gradients")])
def test_unfreezing_in_a_listener_stops_the_fit_there_and_the_next_fit_trains_it(workers, mode):
    """Before, the workers kept training the parameters they started with, without a word: the
    unfrozen layer never trained in that fit."""
    torch.manual_seed(0)
    model = _Tower()
    model.emb.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    frozen = model.emb.weight.detach().clone()
    head = model.head.weight.detach().clone()
    listener = _AtEpoch(1, lambda: model.emb.requires_grad_(True))
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), optimizer=opt, workers=workers,
                         training_mode=mode, listeners=[listener], progress=False) as w:
        with pytest.raises(ValueError, match=r"emb\.weight now trains.*epoch 1 began.*"
                                             r"initial_epoch=1"):
            w.fit(_batches(), epochs=3)
        assert w.stats()["batches"] == 8  # epoch 0 trained, and kept in the model
        assert not torch.equal(model.head.weight, head)
        assert torch.equal(model.emb.weight, frozen)
        w.fit(_batches(), epochs=3, initial_epoch=1)
        assert w.stats()["batches"] == 16
    assert not torch.equal(model.emb.weight, frozen)


def test_a_param_group_added_in_a_listener_stops_the_fit_with_the_way_on():
    """Before, worker 0 failed on the epoch's first round ("the optimizer has 2 param groups
    but the replicas' has 1: add param groups before the first fit()"), and the WorkerError
    left the model without epoch 0's training."""
    torch.manual_seed(0)
    model = _Tower()
    model.emb.requires_grad_(False)
    opt = torch.optim.SGD(model.head.parameters(), lr=0.1, momentum=0.9)
    before = model.head.weight.detach().clone()

    def add_group() -> None:
        model.emb.requires_grad_(True)
        opt.add_param_group({"params": model.emb.parameters(), "lr": 0.01})

    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), optimizer=opt, workers=2,
                         listeners=[_AtEpoch(1, add_group)], progress=False) as w:
        with pytest.raises(ValueError, match=r"2 param groups \(it had 1\)"):
            w.fit(_batches(), epochs=2)
        assert not torch.equal(model.head.weight, before)
        momentum = opt.state[model.head.weight]["momentum_buffer"]
        assert momentum is not None  # epoch 0's optimizer state came back too
        emb = model.emb.weight.detach().clone()
        w.fit(_batches(), epochs=2, initial_epoch=1)
    assert len(opt.param_groups) == 2 and opt.param_groups[1]["lr"] == 0.01
    assert not torch.equal(model.emb.weight, emb)


def test_unfreezing_after_the_last_epoch_is_no_error_and_applies_from_the_next_fit():
    torch.manual_seed(0)
    model = _Tower()
    model.emb.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    frozen = model.emb.weight.detach().clone()

    class _Last(TrainingListener):
        def on_epoch_end(self, epoch: int, loss: float) -> None:
            if epoch == 1:
                model.emb.requires_grad_(True)

    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), optimizer=opt, workers=2,
                         listeners=[_Last()], progress=False) as w:
        w.fit(_batches(), epochs=2)
        assert torch.equal(model.emb.weight, frozen)
        w.fit(_batches())
    assert not torch.equal(model.emb.weight, frozen)


@pytest.mark.parametrize("workers", [1, 2])
def test_an_optimizers_state_dict_hooks_keep_their_keys_and_the_state_comes_back(workers):
    """The replicas' optimizers run none of the user's hooks: before, the state a post hook
    added was missing from what came back, the user's load pre hook raised KeyError, and the
    trained optimizer state was dropped without a warning (Adam's step stayed empty)."""
    torch.manual_seed(0)
    model = _Tower()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    seen: list[int] = []

    def add(optimizer: torch.optim.Optimizer, state: dict) -> dict:
        state["my_counter"] = 7
        return state

    def take(optimizer: torch.optim.Optimizer, state: dict) -> None:
        seen.append(state.pop("my_counter"))

    opt.register_state_dict_post_hook(add)
    opt.register_load_state_dict_pre_hook(take)
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), optimizer=opt, workers=workers,
                         progress=False) as w:
        w.fit(_batches())
    steps = {float(s["step"]) for s in opt.state.values()}
    assert steps == {8.0 / workers} and seen[-1] == 7
