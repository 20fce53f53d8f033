"""DDP's errors in paraloom's terms: the ParallelWrapper option, not DDP's constructor."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from paraloom import ParallelWrapper, WorkerError
from paraloom.sync.ddp_errors import explain_ddp_error

pytestmark = pytest.mark.timeout(120)


class HalfUsed(nn.Module):
    """Two heads; forward uses only the first: ``b`` never gets a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 2)
        self.b = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x)


def _fit(**options) -> nn.Module:
    torch.manual_seed(0)
    model = HalfUsed()
    data = [(torch.randn(8, 4), torch.randint(0, 2, (8,))) for _ in range(8)]
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), workers=2, progress=False,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1), timeout=60,
                         training_mode="allreduce", **options) as wrapper:
        wrapper.fit(data)
    return model


def test_unused_parameters_are_named_with_the_wrapper_option_that_allows_them() -> None:
    with pytest.raises(WorkerError) as caught:
        _fit()
    message = str(caught.value).split("Traceback in the worker")[0]
    assert "(b.weight, b.bias)" in message
    assert "find_unused_parameters=True to ParallelWrapper" in message
    assert "torch.nn.parallel.DistributedDataParallel`" in message  # DDP's words, quoted after


def test_the_option_it_names_trains_the_model() -> None:
    torch.manual_seed(0)
    untouched = HalfUsed()  # the model _fit() starts from
    model = _fit(find_unused_parameters=True)
    assert torch.equal(model.b.weight, untouched.b.weight)  # no gradient: b never moved
    assert not torch.equal(model.a.weight, untouched.a.weight)


def test_other_ddp_advice_names_the_wrapper_keywords() -> None:
    error = RuntimeError("Your training graph has changed in this iteration. This is not "
                         "compatible with static_graph=True set in the DDP constructor.")
    explained = explain_ddp_error(error, HalfUsed())
    assert isinstance(explained, RuntimeError)
    assert "static_graph=... is a ParallelWrapper keyword" in str(explained)
    assert explain_ddp_error(ValueError("a loss went NaN"), HalfUsed()) is None


class Checkpointed(nn.Module):
    """One block run twice under activation checkpointing (``reentrant``: the old default)."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.a, self.b, self.h = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        z = torch.relu(self.a(x))
        for _ in range(2):
            z = checkpoint(lambda t: torch.relu(self.b(t)), z, use_reentrant=self.reentrant)
        return self.h(z)


def _fit_checkpointed(reentrant: bool) -> None:
    torch.manual_seed(0)
    model = Checkpointed(reentrant)
    data = [(torch.randn(4, 4), torch.randint(0, 2, (4,))) for _ in range(3)]  # one idle round
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), workers=2, progress=False,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1), timeout=60,
                         training_mode="allreduce") as wrapper:
        wrapper.fit(data)


def test_a_gradient_ready_twice_names_reentrant_checkpointing_and_the_fixes() -> None:
    with pytest.raises(WorkerError) as caught:
        _fit_checkpointed(reentrant=True)
    message = str(caught.value).split("Traceback in the worker")[0]
    assert "use_reentrant=False" in message and "static_graph=True to ParallelWrapper" in message
    assert "_set_static_graph" not in message.split("(DistributedDataParallel said")[0]
    _fit_checkpointed(reentrant=False)  # the first fix it names trains, idle round included


def test_ddp_advice_to_call_set_static_graph_names_the_keyword_once() -> None:
    error = RuntimeError("Your DDP model does odd things; try to use _set_static_graph() as a "
                         "workaround if this module graph does not change during training loop.")
    text = str(explain_ddp_error(error, HalfUsed()))
    assert "_set_static_graph()" not in text and "static_graph=True" in text
    assert text.count("Your DDP model does odd things") == 1
