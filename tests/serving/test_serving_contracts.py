"""What the server answers when a model breaks the signature it declares, when a request
fails before anything succeeded, and for floats JSON has no numbers for."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from serving_helpers import Client, closing, infer_json
from torch import nn

from paraloom.serving import TensorSpec, create_app
from paraloom.serving.handlers import Handler, HandlerFailedError
from paraloom.serving.handling import select_outputs
from paraloom.serving.protocol import encode_infer_response, parse_infer_request
from paraloom.serving.signature import ModelSignature


class Doubles(nn.Module):
    """Returns float64 columns of the input's width: not what the tests below declare."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.double() * 2


def _post(model: nn.Module, x: torch.Tensor, **app_options: object) -> tuple[int, dict]:
    app = create_app(model, name="m", workers=1, **app_options)  # type: ignore[arg-type]
    client = Client(app)
    body = infer_json(x, name="x")
    body["inputs"][0]["datatype"] = "INT64" if x.dtype == torch.int64 else "FP32"
    try:
        r = client.post("/v2/models/m/infer", json=body)
        return r.status_code, r.json()
    finally:
        client.close()
        closing(app)


def test_an_output_that_breaks_its_declared_datatype_or_shape_is_500_naming_it() -> None:
    x = torch.ones(2, 3)
    inputs = [TensorSpec("x", "FP32", (-1, 3))]
    status, body = _post(Doubles(), x, inputs=inputs,
                         outputs=[TensorSpec("y", "FP32", (-1, 3))])
    assert status == 500
    assert "returned FP64 [2, 3] for 'y', declared FP32 [-1, 3]" in body["error"]
    status, body = _post(Doubles(), x, inputs=inputs,
                         outputs=[TensorSpec("y", "FP64", (-1, 4))])
    assert status == 500 and "FP64 [2, 3] for 'y', declared FP64 [-1, 4]" in body["error"]
    status, body = _post(Doubles(), x, inputs=inputs,
                         outputs=[TensorSpec("y", "FP64", (-1, 3))])
    assert status == 200 and body["outputs"][0]["data"] == [2.0] * 6


def test_outputs_read_off_a_probe_keep_their_sizes_free() -> None:
    # Found by running the model on a 3-wide sample: a 5-wide request's 5-wide output is
    # still the model's own answer (only the datatype and the number of dimensions hold).
    app = create_app(Doubles(), name="m", workers=1, sample=torch.zeros(1, 3),
                     inputs=[TensorSpec("x", "FP32", (-1, -1))])
    client = Client(app)
    try:
        meta = client.get("/v2/models/m").json()
        assert meta["outputs"] == [{"name": "output", "datatype": "FP64", "shape": [-1, 3]}]
        r = client.post("/v2/models/m/infer", json=infer_json(torch.ones(1, 5), name="x"))
        assert r.status_code == 200 and r.json()["outputs"][0]["shape"] == [1, 5]
    finally:
        client.close()
        closing(app)


def _served_with(postprocess: object) -> SimpleNamespace:
    model = ModelSignature((TensorSpec("x", "FP32", (-1, 2)),), (TensorSpec("y", "FP32", (-1, 2)),))
    public = ModelSignature((TensorSpec("x", "FP32", (-1, 2)),),
                            (TensorSpec("n", "INT32", (-1,)),))
    handler = Handler(Path("handler.py"), None, postprocess, public, model)  # type: ignore[arg-type]
    return SimpleNamespace(signature=public, handler=handler)


def test_a_postprocess_that_returns_another_datatype_or_rank_fails_its_request() -> None:
    request = parse_infer_request(json.dumps({"inputs": [
        {"name": "x", "shape": [2, 2], "datatype": "FP32", "data": [0, 0, 0, 0]}]}).encode())
    right = _served_with(lambda out: {"n": np.arange(len(out), dtype=np.int32)})
    result = right.handler.from_model(torch.zeros(2, 2))
    [answer] = select_outputs(right, request, result)  # type: ignore[arg-type]
    assert answer.name == "n" and answer.value.dtype == torch.int32
    for wrong, said in ((np.array([1.5, 1.5], dtype=np.float32), "FP32 [2] for 'n'"),
                        (np.zeros((2, 2), dtype=np.int32), "INT32 [2, 2] for 'n'")):
        served = _served_with(lambda out, wrong=wrong: {"n": wrong})
        with pytest.raises(HandlerFailedError, match=re.escape(f"postprocess returned {said}")):
            select_outputs(served, request,  # type: ignore[arg-type]
                           served.handler.from_model(torch.zeros(2, 2)))


def test_an_output_asked_for_twice_is_400() -> None:
    app = create_app(nn.Linear(3, 2), name="m", workers=1)
    client = Client(app)
    try:
        body = infer_json(torch.ones(1, 3))
        body["outputs"] = [{"name": "output"}, {"name": "output"}]
        r = client.post("/v2/models/m/infer", json=body)
        assert r.status_code == 400 and "more than once" in r.json()["error"]
    finally:
        client.close()
        closing(app)


class Lookup(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(10, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table(ids).sum(1)


class RefusesZeros(Lookup):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not bool(ids.any()):
            raise ValueError("all ids are padding")
        return super().forward(ids)


@pytest.mark.parametrize(("model", "status"), [(Lookup(), 400), (RefusesZeros(), 500)])
def test_a_declared_model_blames_a_first_bad_request_when_zeros_run(model: nn.Module,
                                                                     status: int) -> None:
    # Declared inputs and outputs (as a config.pbtxt gives): the pool is warmed on zeros of
    # the declared shapes where the model takes them, so the first request that fails alone
    # is the request's fault (400), as a later one is; where zeros fail, nothing is known
    # about the model yet and the failure stays the model's (500).
    ids = torch.tensor([[1, 2, 50]])
    status_got, body = _post(model, ids, inputs=[TensorSpec("x", "INT64", (-1, 3))],
                             outputs=[TensorSpec("y", "FP32", (-1, 4))])
    assert status_got == status, body
    assert "index out of range" in body["error"]


def test_non_finite_floats_travel_in_json_as_triton_writes_them() -> None:
    values = torch.tensor([[float("inf"), -float("inf"), float("nan"), 1.5]])
    body, json_length = encode_infer_response(model_name="m", model_version="1",
                                              request_id=None, outputs=[("y", values, False)])
    assert json_length is None
    assert b"[Infinity,-Infinity,NaN,1.5]" in body
    data = json.loads(body)["outputs"][0]["data"]
    assert data[:2] == [float("inf"), -float("inf")] and np.isnan(data[2])
    # tritonclient writes its JSON data with Python's json, which writes them the same way.
    request = json.dumps({"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32",
                                      "data": values.tolist()}]}).encode()
    assert b"NaN" in request
    parsed = parse_infer_request(request)
    assert torch.equal(parsed.inputs[0].tensor.isnan(), values.isnan())
    assert parsed.inputs[0].tensor[0, :2].tolist() == [float("inf"), -float("inf")]
    with pytest.raises(ValueError, match="JSON"):
        parse_infer_request(b'{"inputs": NaN, ')


@pytest.mark.parametrize("where", ["data", "id"])
def test_a_lone_surrogate_is_refused_beside_nan_as_without_it(where: str) -> None:
    """With NaN in the body the JSON is read by Python's json, which took a lone surrogate
    ("\\ud800"): a 500 from the model's string encoding, or from the answer's id, later."""
    data, request_id = (r'["NaN", "\ud800"]', '"a"') if where == "data" else \
        ('["NaN"]', r'"\ud800"')
    rows = data.count(",") + 1
    body = ('{"id": ' + request_id + ', "inputs": [{"name": "t", "datatype": "BYTES", '
            f'"shape": [{rows}], "data": ' + data + '}]}').encode()
    with pytest.raises(ValueError, match="lone UTF-16 surrogate"):
        parse_infer_request(body)
    pair = json.dumps({"id": "\U0001F600 NaN", "inputs": [
        {"name": "t", "datatype": "BYTES", "shape": [2], "data": ["NaN", "\U0001F600"]}]})
    assert r"\ud83d\ude00" in pair  # an escaped pair reads as its one character
    parsed = parse_infer_request(pair.encode())
    assert parsed.id == "\U0001F600 NaN"
    assert list(parsed.inputs[0].tensor) == [b"NaN", "\U0001F600".encode()]
