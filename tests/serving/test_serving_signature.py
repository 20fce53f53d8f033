"""Model signatures: inferred from the model or a sample, declared, and enforced on requests."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from paraloom.models import MLP, LeNet
from paraloom.serving.errors import ProtocolError
from paraloom.serving.protocol import RequestInput
from paraloom.serving.signature import ModelSignature, TensorSpec, infer_signature


def test_lenet_signature_comes_from_its_config() -> None:
    sig = infer_signature(LeNet(image_size=8))
    assert [s.as_json() for s in sig.inputs] == [
        {"name": "input", "datatype": "FP32", "shape": [-1, 1, 8, 8]}]
    assert [s.as_json() for s in sig.outputs] == [
        {"name": "output", "datatype": "FP32", "shape": [-1, 10]}]


def test_mlp_and_plain_linear_models_are_read_from_their_first_layer() -> None:
    assert infer_signature(MLP(in_features=12, num_classes=3)).inputs[0].shape == (-1, 12)
    sig = infer_signature(nn.Sequential(nn.Linear(5, 7), nn.Tanh()))
    assert (sig.inputs[0].shape, sig.outputs[0].shape) == ((-1, 5), (-1, 7))


def test_training_mode_and_batchnorm_stats_survive_the_probe() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).train()
    before = model[1].running_mean.clone()
    infer_signature(model)
    assert model.training
    assert torch.equal(model[1].running_mean, before)


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(3, 4)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.body(a) + b.float()
        return {"logits": h, "label": h.argmax(dim=1)}


def test_sample_gives_multiple_inputs_and_named_outputs() -> None:
    sample = (torch.zeros(1, 3), torch.zeros(1, 4, dtype=torch.int64))
    sig = infer_signature(TwoHeads(), sample=sample)
    assert [(s.name, s.datatype, s.shape) for s in sig.inputs] == [
        ("input_0", "FP32", (-1, 3)), ("input_1", "INT64", (-1, 4))]
    assert [(s.name, s.datatype, s.shape) for s in sig.outputs] == [
        ("logits", "FP32", (-1, 4)), ("label", "INT64", (-1,))]
    named = dict(sig.name_outputs({"label": torch.ones(2), "logits": torch.zeros(2, 4)}))
    assert list(named) == ["logits", "label"]


def test_convolutions_without_a_known_size_ask_for_a_sample() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten())
    with pytest.raises(ValueError, match=r"pass sample=torch.zeros\(1, ...\) or outputs="):
        infer_signature(model)
    sig = infer_signature(model, sample=torch.zeros(1, 3, 5, 5))
    assert (sig.inputs[0].shape, sig.outputs[0].shape) == ((-1, 3, 5, 5), (-1, 36))


def test_a_model_without_layers_to_read_asks_for_inputs() -> None:
    with pytest.raises(ValueError, match="cannot infer the input of Identity"):
        infer_signature(nn.Identity())
    spec = TensorSpec("x", "FP64", (-1, 2))
    sig = infer_signature(nn.Identity(), inputs=[spec])
    assert sig.outputs == (TensorSpec("output", "FP64", (-1, 2)),)


def test_tensor_spec_checks_itself() -> None:
    with pytest.raises(ValueError, match="expected one of"):
        TensorSpec("x", "float32", (1,))
    with pytest.raises(ValueError, match="-1 for a dimension of any size"):
        TensorSpec("x", "FP32", (-2,))


def request(name: str = "input", datatype: str = "FP32", shape: tuple[int, ...] = (2, 1, 8, 8)
            ) -> RequestInput:
    return RequestInput(name, datatype, shape, torch.zeros(shape))


@pytest.mark.parametrize(("given", "message"), [
    (request(name="image"), "unknown: ['image'], missing: ['input']"),
    (request(datatype="FP64"), "datatype FP64 but the model expects FP32; send FP32"),
    (request(shape=(2, 8, 8)), "shape [2, 8, 8] but the model expects [-1, 1, 8, 8]"),
    (request(shape=(2, 1, 8, 9)), "shape [2, 1, 8, 9]"),
    (request(shape=(0, 1, 8, 8)), "no rows"),
])
def test_requests_that_do_not_fit_the_signature_are_refused(given: RequestInput,
                                                            message: str) -> None:
    sig = infer_signature(LeNet(image_size=8))
    with pytest.raises(ProtocolError) as info:
        sig.check([given])
    assert message in str(info.value)


def test_fitting_requests_come_back_in_the_models_input_order() -> None:
    sig = infer_signature(TwoHeads(), sample=(torch.zeros(1, 3), torch.zeros(1, 4)))
    b, a = request("input_1", shape=(5, 4)), request("input_0", shape=(5, 3))
    tensors = sig.check([b, a])
    assert [tuple(t.shape) for t in tensors] == [(5, 3), (5, 4)]


class _Returns(nn.Module):
    def __init__(self, what: str) -> None:
        super().__init__()
        self.linear, self.what = nn.Linear(4, 2), what

    def forward(self, x: torch.Tensor) -> object:
        y = self.linear(x)
        return {"none": (y, None), "keys": {0: y}, "scalar": y.sum()}[self.what]


@pytest.mark.parametrize(("what", "message"), [
    ("none", "returns a NoneType as 'output_1', which cannot be served"),
    ("keys", "returns a dict with key 0: outputs are named by string keys"),
    ("scalar", "returns a 0-d tensor as 'output'; a served model answers with a row per"),
])
def test_outputs_that_cannot_be_served_are_refused_at_start(what: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        infer_signature(_Returns(what))


class _SumsRows(nn.Module):
    """An output without a batch dimension: the rows summed."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).sum(0)


def test_a_model_without_a_row_per_input_row_is_refused_where_requests_are_batched() -> None:
    from paraloom.serving import create_app

    assert infer_signature(_SumsRows()).rowless == ("output",)
    assert infer_signature(LeNet(image_size=8)).rowless == ()
    with pytest.raises(ValueError, match=r"outputs \['output'\] without a row per input row.*"
                                         "--mode sequential"):
        create_app(_SumsRows().eval(), name="sums", workers=1)
    app = create_app(_SumsRows().eval(), name="sums", workers=1, inference_mode="sequential")
    app.state.served.pool.close()  # one request at a time: served as it is


def test_inputs_with_different_rows_are_named_with_their_rows() -> None:
    # Declared in the order the model takes them, which need not be the order sent.
    sig = ModelSignature(inputs=(TensorSpec("INPUT__1", "FP32", (-1, 2)),
                                 TensorSpec("INPUT__0", "FP32", (-1, 2))),
                         outputs=(TensorSpec("OUTPUT__0", "FP32", (-1, 2)),))
    given = [request("INPUT__0", shape=(2, 2)), request("INPUT__1", shape=(3, 2))]
    with pytest.raises(ProtocolError, match=r"\('INPUT__1': 3, 'INPUT__0': 2\)"):
        sig.check(given, batched=True)
    assert len(sig.check(given)) == 2  # without a batch dimension, lengths may differ
    assert len(sig.check([request("INPUT__0", shape=(3, 2)), given[1]], batched=True)) == 2


def test_an_inferred_input_takes_the_first_layers_dtype() -> None:
    signature = infer_signature(nn.Sequential(nn.Linear(4, 2)).double())
    assert signature.inputs == (TensorSpec("input", "FP64", (-1, 4)),)
    assert signature.outputs[0].datatype == "FP64"


def test_a_loaded_lazy_layer_is_read_from_its_weight() -> None:
    model = nn.Sequential(nn.LazyLinear(3), nn.ReLU(), nn.Linear(3, 1))
    with pytest.raises(ValueError, match="cannot infer the input"):
        infer_signature(model)  # not materialized: nothing to read
    model(torch.ones(2, 5))
    fresh = nn.Sequential(nn.LazyLinear(3), nn.ReLU(), nn.Linear(3, 1))
    fresh.load_state_dict(model.state_dict())  # as paraloom.load fills it: in_features stays 0
    assert infer_signature(fresh).inputs == (TensorSpec("input", "FP32", (-1, 5)),)


def test_classification_ranks_integers_exactly() -> None:
    from paraloom.serving.classification import classify

    big = torch.tensor([[2**53, 2**53 + 1, 5]])
    assert classify(big, 1, True, (), "y").tolist() == [[b"9007199254740993:1"]]


@pytest.mark.parametrize(("dtype", "top"), [(torch.uint16, 2**16 - 1),
                                            (torch.uint32, 2**32 - 1),
                                            (torch.uint64, 2**64 - 1)])
def test_classification_ranks_wide_unsigned_integers_exactly(dtype, top) -> None:
    # torch has no topk for these types; a double would tie 2**64 - 1 with 2**64 - 2.
    from paraloom.serving.classification import classify

    scores = torch.tensor([[top - 1, 7, top, 2**15]], dtype=torch.uint64).to(dtype)
    assert classify(scores, 3, True, (), "y").tolist() == [
        [f"{top}:2".encode(), f"{top - 1}:0".encode(), f"{2**15}:3".encode()]]


class _Bag(nn.Module):
    """A text classifier over rows of token ids (0: padding)."""

    def __init__(self) -> None:
        super().__init__()
        self.bag, self.head = nn.EmbeddingBag(12, 8, padding_idx=0), nn.Linear(8, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.bag(ids))


class _Conditioned(nn.Module):
    """Features in; an Embedding registered first that forward does not take input from."""

    def __init__(self) -> None:
        super().__init__()
        self.bias_of = nn.Embedding(1, 3)
        self.fc = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + self.bias_of.weight


def test_a_model_of_token_ids_is_read_from_its_embedding() -> None:
    """The first Linear (the head) was taken: FP32 [-1, 8], on which an EmbeddingBag fails."""
    sig = infer_signature(_Bag())
    assert sig.inputs == (TensorSpec("input", "INT64", (-1, -1)),)
    assert sig.outputs == (TensorSpec("output", "FP32", (-1, 2)),)
    ids = RequestInput("input", "INT64", [2, 5], torch.tensor([[3] * 5, [4, 5, 0, 0, 0]]))
    assert sig.check([ids])[0].shape == (2, 5)  # any length
    features = infer_signature(_Conditioned())  # the Embedding does not take the input: next
    assert features.inputs == (TensorSpec("input", "FP32", (-1, 5)),)
    assert features.outputs == (TensorSpec("output", "FP32", (-1, 3)),)
