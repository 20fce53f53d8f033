"""Request parsing, batch keys, collation and splitting outputs back per request."""

from __future__ import annotations

import dataclasses
from collections import namedtuple

import numpy as np
import pytest
import torch

from paraloom.inference.errors import InvalidRequestError
from paraloom.inference.payload import (
    call_model,
    collate,
    describe_key,
    parse,
    split_output,
    to_numpy,
)

CPU = torch.device("cpu")


def test_a_tensor_request_keys_on_everything_but_its_rows():
    a, b = parse(torch.zeros(3, 1, 8, 8)), parse(torch.ones(5, 1, 8, 8))
    assert (a.rows, b.rows) == (3, 5)
    assert a.key == b.key
    assert parse(torch.zeros(3, 1, 8, 9)).key != a.key
    assert parse(torch.zeros(3, 1, 8, 8, dtype=torch.float64)).key != a.key
    assert describe_key(a.key) == "Tensor(N, 1, 8, 8) float32"


def test_numpy_requests_are_zero_copy_and_flagged():
    arr = np.arange(6, dtype=np.float32).reshape(3, 2)
    p = parse(arr)
    assert p.numpy and p.rows == 3
    arr[0, 0] = 42.0
    assert p.tensors[0][0, 0].item() == 42.0   # a view, not a copy
    assert p.key == parse(torch.zeros(1, 2)).key


def test_reversed_numpy_views_are_copied_once():
    arr = np.arange(6, dtype=np.float32).reshape(3, 2)[::-1]
    assert parse(arr).tensors[0].tolist() == arr.tolist()


def test_multi_input_and_dict_requests():
    t = parse((torch.zeros(2, 3), np.zeros((2, 4), dtype=np.int64)))
    assert t.rows == 2 and t.numpy and t.spec == ("tuple", 2)
    assert describe_key(t.key) == "tuple(Tensor(N, 3) float32, Tensor(N, 4) int64)"
    d = parse({"a": torch.zeros(4, 3), "b": torch.zeros(4)})
    assert d.rows == 4 and not d.numpy
    assert describe_key(d.key) == "{'a': Tensor(N, 3) float32, 'b': Tensor(N) float32}"
    assert parse({"b": torch.zeros(4), "a": torch.zeros(4, 3)}).key != d.key   # order matters
    assert parse([torch.zeros(2, 3), torch.zeros(2, 4)]).key != parse(
        (torch.zeros(2, 3), torch.zeros(2, 4))).key


@pytest.mark.parametrize("bad, message", [
    (torch.tensor(1.0), "0-d tensor.*unsqueeze"),
    (torch.zeros(0, 3), "0 rows"),
    ((torch.zeros(2, 3), torch.zeros(3, 3)), r"disagree on the number of rows \(input\[0\]: 2, "
                                             r"input\[1\]: 3\)"),
    ([1.0, 2.0], r"input\[0\] is a float; expected a torch.Tensor or numpy.ndarray"),
    ("text", "the input is a str"),
    ((), "empty tuple"),
    (np.array([object(), object()]), "numpy dtype object"),
])
def test_malformed_requests_say_what_is_wrong(bad, message):
    with pytest.raises(InvalidRequestError, match=message):
        parse(bad)


def test_collate_concatenates_each_input_once():
    batch = [parse((torch.full((2, 3), float(i)), torch.full((2,), i))).tensors for i in range(3)]
    a, b = collate(batch, CPU)
    assert a.shape == (6, 3) and b.tolist() == [0, 0, 1, 1, 2, 2]


def test_call_model_passes_positional_and_keyword_inputs():
    def model(*args, **kwargs):
        return args, kwargs

    x, y = torch.zeros(1), torch.ones(1)
    assert call_model(model, None, [x]) == ((x,), {})
    assert call_model(model, ("tuple", 2), [x, y]) == ((x, y), {})
    assert call_model(model, ("dict", ("p", "q")), [x, y]) == ((), {"p": x, "q": y})


Pair = namedtuple("Pair", "logits features")


def test_split_output_follows_the_models_structure():
    out = {"y": torch.arange(6).reshape(6, 1), "pair": Pair(torch.arange(6), [torch.zeros(6)]),
           "note": "kept"}
    parts = split_output(out, [1, 2, 3])
    assert [p["y"].flatten().tolist() for p in parts] == [[0], [1, 2], [3, 4, 5]]
    assert isinstance(parts[1]["pair"], Pair)
    assert parts[2]["pair"].logits.tolist() == [3, 4, 5]
    assert parts[2]["pair"].features[0].shape == (3,)
    assert [p["note"] for p in parts] == ["kept"] * 3
    assert parts[1]["y"].data_ptr() == out["y"][1:].data_ptr()     # views, not copies


@dataclasses.dataclass(frozen=True)
class Output:
    """A model output as a dataclass (as many libraries return): split per request, moved and
    converted field by field; a field the constructor does not take is computed again."""

    logits: torch.Tensor
    label: str = "y"
    rows: int = dataclasses.field(init=False, default=0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "rows", self.logits.shape[0] if self.logits.ndim else 0)


def test_a_dataclass_output_is_split_field_by_field():
    out = Output(torch.arange(6).reshape(6, 1) * 10)
    parts = split_output(out, [1, 2, 3])
    assert all(isinstance(p, Output) for p in parts)
    assert [p.logits.flatten().tolist() for p in parts] == [[0], [10, 20], [30, 40, 50]]
    assert [(p.label, p.rows) for p in parts] == [("y", 1), ("y", 2), ("y", 3)]
    converted = to_numpy(out)
    assert isinstance(converted, Output) and isinstance(converted.logits, np.ndarray)
    with pytest.raises(ValueError, match=r"shape \(\) for 3 rows"):  # checked inside it too
        split_output(Output(torch.tensor(1.0)), [1, 2])


def test_split_output_refuses_outputs_without_a_batch_dimension():
    with pytest.raises(ValueError, match=r"shape \(\) for 3 rows merged from 2 requests.*sequ"):
        split_output(torch.tensor(1.0), [1, 2])
    assert split_output(torch.tensor(1.0), [3])[0].item() == 1.0    # alone: nothing to split


def test_to_numpy_handles_bfloat16():
    out = to_numpy((torch.ones(2, dtype=torch.bfloat16), torch.arange(2)))
    assert out[0].dtype == np.float32 and out[1].dtype == np.int64


def test_a_big_endian_array_is_read_in_the_native_order():
    values = np.arange(6, dtype=np.float32).reshape(3, 2)
    parsed = parse(values.astype(">f4"))
    assert parsed.tensors[0].dtype == torch.float32
    assert parsed.tensors[0].tolist() == values.tolist()
