"""A step or an optimizer that cannot train says what it got and what to change."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from paraloom import ParallelWrapper, WorkerError

pytestmark = pytest.mark.timeout(60)

_BATCHES = [(torch.ones(2, 4), torch.zeros(2, dtype=torch.long))] * 2


class _TwoOutputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.linear(x), self.linear(x).sum(dim=1)


def _fail(model: nn.Module, batches=_BATCHES, **options) -> str:
    with ParallelWrapper(model, workers=1, progress=False,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                         **options) as wrapper:
        with pytest.raises(WorkerError) as caught:
            wrapper.fit(batches)
    return str(caught.value)


@pytest.mark.parametrize(("options", "says"), [
    ({"step_fn": lambda model, batch: None}, r"step_fn returned None: .*did it miss a return"),
    ({"loss_fn": lambda out, y: 0.5}, r"loss_fn returned float: a Python number has no "
                                      r"gradient.*not loss\.item\(\)"),
    ({"loss_fn": nn.CrossEntropyLoss(reduction="none")}, r"Tensor\(2,\).*reduction='mean'"),
    ({"loss_fn": lambda out, y: nn.functional.cross_entropy(out, y).detach()},
     r"does not require grad: .*under torch\.no_grad\(\), from \.detach\(\)"),
])
def test_a_loss_that_cannot_train_says_what_came_back_and_the_fix(options, says) -> None:
    assert re.search(says, _fail(nn.Linear(4, 2), **options))


class _NamedOutputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"cls": self.linear(x), "reg": self.linear(x).sum(dim=1)}


@pytest.mark.parametrize(("model", "returned"), [(_TwoOutputs, "tuple"),
                                                 (_NamedOutputs, "{'cls': Tensor(2, 2)")])
def test_a_model_with_two_outputs_and_one_loss_is_told_to_give_one_per_output(
        model: type[nn.Module], returned: str) -> None:
    message = _fail(model(), loss_fn=nn.CrossEntropyLoss())
    assert f"The model returned {returned}" in message
    assert "loss_fn=[loss_a, loss_b, ...]" in message


class _Returns(nn.Module):
    """A model whose forward returns ``kind`` of its output instead of the tensor."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.linear, self.kind = nn.Linear(4, 2), kind

    def forward(self, x: torch.Tensor) -> object:
        y = self.linear(x)
        return {"none": None, "float": float(y.sum()), "numpy": y.detach().numpy()}[self.kind]


@pytest.mark.parametrize(("kind", "says"), [
    ("none", r"forward returned None, .*did forward miss a return"),
    ("float", r"forward returned a float, .*not \.item\(\) or float\(\)"),
    ("numpy", r"forward returned a numpy\.ndarray, .*not \.numpy\(\)"),
])
def test_a_forward_that_returns_no_tensor_is_named(kind: str, says: str) -> None:
    """They failed inside the loss: "'NoneType' object has no attribute 'size'", "'int'
    object is not callable"."""
    assert re.search(says, _fail(_Returns(kind), loss_fn=nn.CrossEntropyLoss()))


def test_several_losses_against_a_dict_of_another_count_describe_the_dict() -> None:
    """The dict was described as the tuple of its values that the losses are paired with."""
    message = _fail(_NamedOutputs(), loss_fn=[nn.CrossEntropyLoss()])
    assert "1 loss functions were given but the model returned {'cls': Tensor(2, 2)" in message


@pytest.mark.parametrize("rows", [2, 16])
def test_one_loss_per_output_against_a_single_target_tensor_asks_for_one_per_output(
        rows: int) -> None:
    """The tensor was zipped with the losses row by row: a raw "zip() argument 3 is longer"
    or a batch-size mismatch, and with as many rows as losses, each output trained against
    one row of the targets broadcast over the batch, silently."""
    batches = [(torch.ones(rows, 4), torch.zeros(rows))] * 2
    message = _fail(_TwoOutputs(), batches=batches, loss_fn=[nn.MSELoss(), nn.MSELoss()])
    assert (f"2 loss functions were given, one per output of tuple(Tensor({rows}, 2) float32, "
            f"Tensor({rows},) float32), but the targets are Tensor({rows},) float32") in message
    assert "(y, y)" in message


def test_a_dict_of_targets_for_outputs_in_a_tuple_asks_for_keys_or_a_tuple() -> None:
    batches = [(torch.ones(2, 4), {"cls": torch.zeros(2, 2), "reg": torch.zeros(2)})] * 2
    message = _fail(_TwoOutputs(), batches=batches, loss_fn=[nn.MSELoss(), nn.MSELoss()])
    assert "return a dict from forward (keys ['cls', 'reg'])" in message


def test_an_empty_batch_is_named_not_blamed_on_the_learning_rate() -> None:
    batches = [_BATCHES[0], (torch.ones(0, 4), torch.zeros(0, dtype=torch.long))]
    message = _fail(nn.Linear(4, 2), batches=batches, loss_fn=nn.CrossEntropyLoss())
    assert "the loss is nan on a batch of 0 rows" in message and "empty batch" in message
    assert "learning rate" not in message


@pytest.mark.parametrize(("data", "yields"), [({"x": torch.ones(8, 4)}, "dict, which yields "
                                                                       "its keys"),
                                              (torch.ones(8, 4), "Tensor, which yields rows")])
def test_a_dict_or_a_tensor_as_the_data_is_refused_naming_what_to_pass(data: object,
                                                                        yields: str) -> None:
    """It was taken as a stream of batches: "a batch must be a pair; got str" (a key)."""
    model = nn.Linear(4, 2)
    with ParallelWrapper(model, workers=1, progress=False, loss_fn=nn.CrossEntropyLoss(),
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) as wrapper:
        with pytest.raises(TypeError, match=f"data is a {yields}, not batches.*TensorDataset"):
            wrapper.fit(data)


def test_integer_inputs_to_a_float_layer_name_the_conversion() -> None:
    batches = [(torch.ones(2, 4, dtype=torch.int64), torch.zeros(2, dtype=torch.long))]
    message = _fail(nn.Linear(4, 2), batches, loss_fn=nn.CrossEntropyLoss())
    assert "the inputs are int64 but the model's parameters are float32: convert the data " \
           "(x.float(), e.g. in the Dataset)" in message


def test_integer_inputs_to_an_embedding_train() -> None:
    model = nn.Sequential(nn.Embedding(10, 2), nn.Flatten(0))
    batches = [(torch.tensor([1, 2]), torch.tensor([0, 1]))] * 2
    with ParallelWrapper(model, loss_fn=lambda out, y: (out.view(2, 2)[:, 0] - y).pow(2).mean(),
                         workers=1, progress=False,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) as wrapper:
        assert wrapper.fit(batches)["batches"] == 2


def test_an_optimizer_over_a_replaced_layer_says_to_build_both_again() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), optimizer=opt, workers=1,
                         progress=False) as wrapper:
        wrapper.fit(_BATCHES)
        model[1] = nn.Linear(4, 2)  # a new head; the optimizer still holds the old one's
        with pytest.raises(ValueError, match=r"2 tensor\(s\) that are not parameters of the "
                                             r"model \(a layer replaced .*a new optimizer and a "
                                             r"new ParallelWrapper"):
            wrapper.fit(_BATCHES)


class _Tempered(nn.Module):
    """Cross-entropy at a learned temperature: a loss of trainable parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.t = nn.Parameter(torch.ones(()))

    def forward(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out / self.t, y)


def _tempered_step(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return model.criterion(model(x), y)


def test_a_loss_of_trainable_parameters_is_refused_with_the_fix_and_the_fix_trains() -> None:
    loss, model = _Tempered(), nn.Linear(4, 2)
    opt = torch.optim.SGD([*model.parameters(), *loss.parameters()], lr=0.1)
    with pytest.raises(ValueError, match=r"a loss of trainable parameters.*model.criterion"):
        ParallelWrapper(model, loss_fn=loss, optimizer=opt, workers=1, progress=False)
    model.criterion = loss  # the fix: the loss's parameters are the model's
    with ParallelWrapper(model, step_fn=_tempered_step, workers=2, progress=False,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) as wrapper:
        assert wrapper.fit(_BATCHES)["batches"] == len(_BATCHES)
    assert float(model.criterion.t) != 1.0  # the temperature trained


def test_a_class_label_past_the_models_outputs_names_the_range() -> None:
    batches = [(torch.ones(2, 4), torch.tensor([0, 5]))] * 2  # the model has 2 classes
    message = _fail(nn.Linear(4, 2), batches, loss_fn=nn.CrossEntropyLoss())
    assert "Target 5 is out of bounds" in message
    assert "outside the model's 2 classes (0 to 1): check the labels' range" in message


def test_one_value_per_row_given_1d_to_a_linear_layer_says_to_make_it_a_column() -> None:
    """Twelve rows of one value reached nn.Linear(1, 1) as (12,): it read one row of 12, and
    the hint said "rows of 12 values" (a Spark scalar column as features="x" gives this)."""
    batches = [(torch.ones(12), torch.zeros(12, 1))] * 2
    message = _fail(nn.Linear(1, 1), batches, loss_fn=nn.MSELoss())
    assert "The inputs are 1-D, 12 rows of one value each" in message
    assert "features=[name] on Spark, x.unsqueeze(1)" in message
    assert "rows of 12 values" not in message


def test_numpy_batches_are_told_to_become_tensors() -> None:
    """torch's own message alone: "linear(): argument 'input' must be Tensor, not
    numpy.ndarray"."""
    batches = [(torch.ones(2, 4).numpy(), torch.zeros(2, dtype=torch.long).numpy())]
    message = _fail(nn.Linear(4, 2), batches=batches, loss_fn=nn.CrossEntropyLoss())
    assert "The inputs are NumPy arrays" in message and "torch.as_tensor(x)" in message
