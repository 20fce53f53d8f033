"""Models with torch.nn.utils.parametrize parametrizations (weight_norm, spectral_norm,
orthogonal) travel to the workers and train, though torch refuses to pickle them."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations, parametrize
from torch.utils.data import DataLoader, TensorDataset

from paraloom import ParallelWrapper
from paraloom.training.parametrized import by_value


class Normed(nn.Module):
    """Three kinds of parametrization, a non-persistent buffer and one layer used twice."""

    def __init__(self) -> None:
        super().__init__()
        self.a = parametrizations.weight_norm(nn.Linear(10, 32))
        self.b = parametrizations.orthogonal(nn.Linear(32, 32))
        self.c = parametrizations.spectral_norm(nn.Linear(32, 3))
        self.again = self.b
        self.register_buffer("scale", torch.tensor(2.0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.a(x * self.scale))
        return self.c(torch.relu(self.again(torch.relu(self.b(hidden)))))


def test_torch_itself_refuses_to_pickle_a_parametrized_module():
    with pytest.raises(RuntimeError, match="only supported through state_dict"):
        pickle.dumps(Normed())


def test_a_parametrized_model_comes_back_whole_with_the_same_outputs_and_gradients():
    torch.manual_seed(0)
    model = Normed().eval()
    copy = pickle.loads(by_value(model))
    x = torch.randn(5, 10)
    assert torch.equal(copy(x), model(x))
    assert type(copy.a).__name__ == "ParametrizedLinear"
    assert parametrize.is_parametrized(copy.b, "weight")
    assert copy.again is copy.b  # one layer used twice stays one layer
    assert copy.scale.item() == 2.0
    assert copy.state_dict().keys() == model.state_dict().keys()
    for key, value in model.state_dict().items():
        assert torch.equal(copy.state_dict()[key], value), key
    copy(x).sum().backward()
    assert copy.a.parametrizations.weight.original0.grad is not None
    assert copy.b.parametrizations.weight.original.grad is not None
    # the copy is a module in its own right: pickled again, and untouched by the original
    again = pickle.loads(by_value(copy))
    with torch.no_grad():
        model.a.parametrizations.weight.original1.add_(1.0)
    assert torch.equal(again(x), copy(x)) and not torch.equal(copy(x), model(x))


@pytest.mark.parametrize("mode", ["averaging", "allreduce"])
def test_a_parametrized_model_trains_on_two_workers(mode):
    torch.manual_seed(0)
    x = torch.randn(2048, 10)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True)
    model = Normed()
    before = model.a.parametrizations.weight.original1.detach().clone()
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(),
                         optimizer=torch.optim.Adam(model.parameters(), lr=1e-2),
                         workers=2, training_mode=mode, progress=False) as wrapper:
        wrapper.fit(loader, epochs=3)
    model.eval()
    with torch.no_grad():
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    assert accuracy > 0.85  # three classes: 0.5 is the majority class
    assert parametrize.is_parametrized(model.a, "weight")  # the user's model keeps its form
    assert not torch.equal(model.a.parametrizations.weight.original1, before)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(10, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


class WithScriptedChild(nn.Module):
    """A model whose first block is TorchScript (torch.jit.script on a child)."""

    def __init__(self) -> None:
        super().__init__()
        self.block = torch.jit.script(_Block())
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


def test_a_model_with_a_scripted_child_is_refused_naming_it():
    from paraloom import NotPicklableError

    model = WithScriptedChild()
    x, y = torch.randn(4, 10), torch.zeros(4, dtype=torch.long)
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), workers=2, progress=False,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) as wrapper:
        with pytest.raises(NotPicklableError, match=r"TorchScript modules \(\['block'\].*script "
                                                    r"them after training"):
            wrapper.fit([(x, y)] * 2)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # torch.nn.utils.weight_norm is legacy
@pytest.mark.parametrize("workers", [1, 2])
def test_the_hook_based_weight_norm_trains_in_process_and_on_workers_as_a_loop(workers):
    # Its weight is a computed tensor, not a graph leaf, which copy.deepcopy refuses.
    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.utils.weight_norm(nn.Linear(10, 16)), nn.Tanh(),
                             nn.Linear(16, 3))

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 10, generator=g), torch.randint(0, 3, (32,), generator=g)
    batches = [(x[i:i + 8 * workers], y[i:i + 8 * workers]) for i in range(0, 32, 8 * workers)]
    plain = model()
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    for xb, yb in batches:
        opt.zero_grad()
        nn.functional.cross_entropy(plain(xb), yb).backward()
        opt.step()
    trained = model()
    split = [(xb[i:i + 8], yb[i:i + 8]) for xb, yb in batches for i in range(0, len(xb), 8)]
    with ParallelWrapper(trained, loss_fn=nn.CrossEntropyLoss(), workers=workers,
                         optimizer=torch.optim.SGD(trained.parameters(), lr=0.1),
                         training_mode="allreduce", progress=False) as wrapper:
        wrapper.fit(split, epochs=1)
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(trained.state_dict()[key], value, rtol=1e-5, atol=1e-6)
