"""The v2 codec: tritonclient's own encoder and decoder are the reference on both sides."""

from __future__ import annotations

import gzip
import json

import ml_dtypes
import numpy as np
import pytest
import torch
import tritonclient.http as th
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.http._utils import _get_inference_request

from paraloom.serving.datatypes import DATATYPES, datatype_of
from paraloom.serving.errors import ProtocolError
from paraloom.serving.protocol import encode_infer_response, parse_infer_request

NUMPY = {"BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32,
         "UINT64": np.uint64, "INT8": np.int8, "INT16": np.int16, "INT32": np.int32,
         "INT64": np.int64, "FP16": np.float16, "BF16": ml_dtypes.bfloat16,
         "FP32": np.float32, "FP64": np.float64}


def client_body(inputs: list[th.InferInput], outputs: list[th.InferRequestedOutput] | None = None
                ) -> tuple[bytes, int | None]:
    """The exact body tritonclient.http would POST."""
    body, header_length = _get_inference_request(inputs, "", outputs, 0, False, False, 0, None,
                                                 None)
    return (body if isinstance(body, bytes) else body.encode()), header_length


def sample(datatype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if datatype == "BOOL":
        return rng.integers(0, 2, shape).astype(bool)
    if datatype.startswith(("INT", "UINT")):
        info = np.iinfo(NUMPY[datatype])
        return rng.integers(max(info.min, -1000), min(info.max, 1000), shape,
                            dtype=np.int64).astype(NUMPY[datatype])
    return (rng.standard_normal(shape) * 10).astype(NUMPY[datatype])


def as_numpy(t: torch.Tensor, datatype: str) -> np.ndarray:
    if datatype == "BF16":
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


@pytest.mark.parametrize("datatype", list(DATATYPES))
@pytest.mark.parametrize("binary", [True, False])
def test_every_datatype_decodes_bit_exactly_from_tritonclient(datatype: str, binary: bool) -> None:
    x = sample(datatype, (2, 3))
    if datatype == "BF16" and not binary:  # tritonclient refuses this; other clients send floats
        body = {"inputs": [{"name": "x", "shape": [2, 3], "datatype": "BF16",
                            "data": x.astype(np.float32).ravel().tolist()}]}
        req = parse_infer_request(json.dumps(body).encode())
    else:
        item = th.InferInput("x", list(x.shape), datatype)
        item.set_data_from_numpy(x, binary_data=binary)
        req = parse_infer_request(*client_body([item]))
    (got,) = req.inputs
    assert (got.name, got.datatype, got.shape) == ("x", datatype, (2, 3))
    assert got.tensor.dtype == DATATYPES[datatype].torch_dtype
    np.testing.assert_array_equal(as_numpy(got.tensor, datatype), x)


@pytest.mark.parametrize("datatype", [d for d in DATATYPES if "INT" in d])
@pytest.mark.parametrize("binary", [True, False])
def test_integers_at_both_ends_of_their_range_decode_exactly(datatype: str, binary: bool) -> None:
    info = np.iinfo(NUMPY[datatype])
    x = np.array([[info.max, 0, 1], [info.min, info.max - 1, 2]], dtype=NUMPY[datatype])
    item = th.InferInput("x", list(x.shape), datatype)
    item.set_data_from_numpy(x, binary_data=binary)
    (got,) = parse_infer_request(*client_body([item])).inputs
    assert got.tensor.dtype == DATATYPES[datatype].torch_dtype
    np.testing.assert_array_equal(got.tensor.numpy(), x)


@pytest.mark.parametrize(("datatype", "data"), [("INT64", [2**63, -1]),
                                                ("UINT64", [-1, 2**64 - 1]),
                                                ("INT64", [2**64, 1]),  # JSON reads it a float
                                                ("UINT64", [2**70, 1]),
                                                ("FP16", [1e6, 1.0]),  # a cast would make inf
                                                ("FP16", [70000, 1]),
                                                ("FP16", [float("nan"), -1e5]),
                                                ("FP32", [float("inf"), 1e39]),
                                                ("FP32", [1e39, 0.0]),
                                                ("FP16", [65520, 0]),
                                                ("BF16", [3.4e38, 0]),
                                                ("BF16", [3.5e38, 0])])  # it said FP32
def test_json_integers_past_the_datatypes_range_are_refused(datatype: str, data: list) -> None:
    body = {"inputs": [{"name": "x", "shape": [2], "datatype": datatype, "data": data}]}
    with pytest.raises(ProtocolError,
                       match=f"(outside {datatype}.s range|that {datatype} cannot hold)"):
        parse_infer_request(json.dumps(body).encode())


@pytest.mark.parametrize("datatype", ["BF16", "FP16", "FP32"])
@pytest.mark.parametrize("nested", [False, True])
def test_a_value_too_large_in_a_tensor_of_rows_is_refused_by_name(datatype: str,
                                                                  nested: bool) -> None:
    """A BF16 tensor of shape [1, 4] with 1e39 in it was a 500 ("too many indices")."""
    data: list = [1e39, 1, 1, 1]
    body = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": datatype,
                        "data": [data] if nested else data}]}
    with pytest.raises(ProtocolError, match=f"such as 1e.39 that {datatype} cannot hold"):
        parse_infer_request(json.dumps(body).encode())


def test_json_floats_at_the_ends_of_fp16_and_infinities_decode() -> None:
    body = {"inputs": [{"name": "x", "shape": [3], "datatype": "FP16",
                        "data": [65504.0, float("-inf"), -65504]}]}
    (got,) = parse_infer_request(json.dumps(body).encode()).inputs
    assert got.tensor.tolist() == [65504.0, float("-inf"), -65504.0]
    body["inputs"][0]["data"] = [65519.0, 3.0, -65519]  # they round to FP16's largest
    (got,) = parse_infer_request(json.dumps(body).encode()).inputs
    assert got.tensor.tolist() == [65504.0, 3.0, -65504.0]
    fp32 = {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32",
                        "data": [3.4028235e38]}]}  # FLT_MAX as numpy, JS and Go print it
    (got,) = parse_infer_request(json.dumps(fp32).encode()).inputs
    assert got.tensor.item() == torch.finfo(torch.float32).max
    body["inputs"][0]["data"] = [float("inf"), float("nan"), float("inf")]  # no finite value
    (got,) = parse_infer_request(json.dumps(body).encode()).inputs
    assert got.tensor.isinf().sum() == 2 and got.tensor.isnan().sum() == 1


@pytest.mark.parametrize("datatype", list(DATATYPES))
@pytest.mark.parametrize("binary", [True, False])
def test_every_datatype_encodes_for_tritonclient(datatype: str, binary: bool) -> None:
    x = sample(datatype, (3, 2), seed=1)
    tensor = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16) if datatype == "BF16" \
        else torch.from_numpy(x)
    body, header_length = encode_infer_response(
        model_name="m", model_version="3", request_id="r1", outputs=[("y", tensor, binary)])
    assert (header_length is not None) == binary
    result = th.InferResult.from_response_body(body, header_length=header_length)
    response = result.get_response()
    assert (response["model_name"], response["model_version"], response["id"]) == ("m", "3", "r1")
    assert response["outputs"][0]["datatype"] == datatype
    got = result.as_numpy("y")
    if datatype == "BF16" and not binary:  # JSON carries BF16 as the float32 it widens to
        got = got.astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(got.astype(x.dtype), x)


def test_mixed_binary_and_json_inputs_and_requested_outputs() -> None:
    a, b = sample("FP32", (1, 4)), sample("INT64", (1, 2))
    ia, ib = th.InferInput("a", [1, 4], "FP32"), th.InferInput("b", [1, 2], "INT64")
    ia.set_data_from_numpy(a, binary_data=True)
    ib.set_data_from_numpy(b, binary_data=False)
    outs = [th.InferRequestedOutput("y", binary_data=False), th.InferRequestedOutput("z")]
    req = parse_infer_request(*client_body([ia, ib], outs))
    np.testing.assert_array_equal(req.inputs[0].tensor.numpy(), a)
    np.testing.assert_array_equal(req.inputs[1].tensor.numpy(), b)
    assert [(o.name, o.binary) for o in req.outputs] == [("y", False), ("z", True)]
    assert req.binary_output is False


def test_no_requested_outputs_means_all_outputs_as_binary_for_tritonclient() -> None:
    item = th.InferInput("x", [1], "FP32")
    item.set_data_from_numpy(np.ones(1, np.float32))
    req = parse_infer_request(*client_body([item]))
    assert req.outputs is None and req.binary_output is True


def test_nested_json_data_is_accepted_row_major() -> None:
    body = {"id": 7, "inputs": [{"name": "x", "shape": [2, 2], "datatype": "INT32",
                                 "data": [[1, 2], [3, 4]]}]}
    req = parse_infer_request(json.dumps(body).encode())
    assert req.id == "7"
    assert req.inputs[0].tensor.tolist() == [[1, 2], [3, 4]]


@pytest.mark.parametrize("request_id", [{"a": 1}, [1, 2]])
def test_a_request_id_that_is_an_object_or_array_is_refused(request_id: object) -> None:
    """It was echoed back as Python's text of the object ("{'a': 1}")."""
    body = {"id": request_id, "inputs": [{"name": "x", "shape": [1], "datatype": "FP32",
                                          "data": [1.0]}]}
    with pytest.raises(ProtocolError, match="request id must be a string"):
        parse_infer_request(json.dumps(body).encode())


def json_request(**fields: object) -> bytes:
    item = {"name": "x", "shape": [2], "datatype": "FP32", "data": [1.0, 2.0]}
    item.update(fields)
    return json.dumps({"inputs": [item]}).encode()


@pytest.mark.parametrize(("body", "message"), [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b'{"outputs": []}', "no 'inputs' field"),
    (b'{"inputs": []}', "empty 'inputs'"),
    (b'{"inputs": {"x": 1}}', "must be an array"),
    (b'{"inputs": [3]}', "must be an object"),
    (json_request(name=None), "no 'name' field"),
    (json_request(shape=[2.5]), "non-negative integers"),
    (json_request(shape=[-1]), "non-negative integers"),
    (json_request(datatype="fp32"), "unknown datatype 'fp32'"),
    (json_request(datatype="BYTES"), "BYTES"),
    (json_request(data=[1.0, 2.0, 3.0]), "3 data elements but shape [2] needs 2"),
    (json_request(data=[[1.0], [2.0, 3.0]]), "not a rectangular array"),
    (json_request(data=["a", "b"]), "string values"),
    (json_request(datatype="INT8", data=[1.5, 2.0]), "floating-point values"),
    (json_request(datatype="INT8", data=[1, 300]), "outside INT8's range"),
    (json_request(datatype="UINT8", data=[-1, 3]), "outside UINT8's range"),
    (json_request(datatype="BOOL", data=[1, 0]), "integer values"),
    (json_request(datatype="FP32", data=[True, False]), "boolean values"),
    (json_request(parameters={"binary_data_size": 8}), "both 'data' and parameters.binary"),
    (json_request(datatype="INT32", data=[True, False]), "boolean values"),
    # numpy read a boolean beside numbers as 1 or 0: the request was answered
    (json_request(datatype="INT64", data=[True, 7]), "boolean values, which datatype INT64"),
    (json_request(datatype="FP32", data=[0.5, False]), "boolean values"),
    (json_request(datatype="UINT8", shape=[2, 2], data=[[1, 2], [False, 200]]), "boolean values"),
    (json_request(datatype="BF16", data=[True, 0.5]), "boolean values, which datatype BF16"),
    (json.dumps({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32"}]}).encode(),
     "neither 'data' nor"),
    (json.dumps({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]},
                            {"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}]}
                ).encode(), "more than once"),
    (json.dumps({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}],
                 "outputs": [{"name": "y", "parameters": {"classification": -1}}]}).encode(),
     "classification -1; expected the number of classes"),
    (json.dumps({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}],
                 "parameters": {"binary_data_output": "yes"}}).encode(), "must be a boolean"),
])
def test_bad_json_requests_say_what_is_wrong(body: bytes, message: str) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_infer_request(body)
    assert message in str(info.value)
    assert info.value.status == 400


def binary_request(size: int, payload: bytes, shape: tuple[int, ...] = (2,)) -> tuple[bytes, int]:
    head = json.dumps({"inputs": [{"name": "x", "shape": list(shape), "datatype": "FP32",
                                   "parameters": {"binary_data_size": size}}]}).encode()
    return head + payload, len(head)


@pytest.mark.parametrize(("size", "payload", "header_delta", "message"), [
    (8, b"\0" * 8, None, "not valid JSON"),  # binary body without the header length
    (8, b"\0" * 8, 10_000, "but the body has"),
    (4, b"\0" * 4, 0, "binary_data_size 4 but shape [2] of FP32 needs 8"),
    (8, b"\0" * 4, 0, "has only 4 bytes after the JSON header"),
    (8, b"\0" * 12, 0, "body has 12 bytes after the JSON header but the inputs declare 8"),
    (-8, b"", 0, "binary_data_size -8"),
])
def test_bad_binary_requests_say_what_is_wrong(size: int, payload: bytes,
                                               header_delta: int | None, message: str) -> None:
    body, header_length = binary_request(size, payload)
    length = None if header_delta is None else header_length + header_delta
    with pytest.raises(ProtocolError) as info:
        parse_infer_request(body, length)
    assert message in str(info.value)


def test_binary_size_without_header_length_is_explained() -> None:
    head = json.dumps({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32",
                                   "parameters": {"binary_data_size": 4}}]}).encode()
    with pytest.raises(ProtocolError, match="no Inference-Header-Content-Length header"):
        parse_infer_request(head)


def test_decoded_binary_tensors_are_writable_copies() -> None:
    body, header_length = binary_request(8, np.array([1, 2], np.float32).tobytes())
    tensor = parse_infer_request(body, header_length).inputs[0].tensor
    tensor.add_(1)  # a view over the read-only body would warn or fail here
    assert tensor.tolist() == [2.0, 3.0]


def test_datatype_of_names_unsupported_dtypes() -> None:
    assert datatype_of(torch.float32) == "FP32"
    with pytest.raises(TypeError, match="complex64 has no Open Inference Protocol datatype"):
        datatype_of(torch.complex64)


def test_gzip_is_not_the_codec_job() -> None:
    # The codec sees bytes after HTTP decoding; a compressed body here is simply not JSON.
    with pytest.raises(ProtocolError, match="not valid JSON"):
        parse_infer_request(gzip.compress(json_request()))


@settings(max_examples=60, deadline=None)
@given(datatype=st.sampled_from(list(DATATYPES)),
       shape=st.lists(st.integers(0, 4), min_size=1, max_size=4).map(tuple),
       binary=st.booleans(), seed=st.integers(0, 2**16))
def test_round_trip_through_tritonclient_for_any_shape(datatype: str, shape: tuple[int, ...],
                                                       binary: bool, seed: int) -> None:
    binary = binary or datatype == "BF16"
    x = sample(datatype, shape, seed)
    item = th.InferInput("x", list(shape), datatype)
    item.set_data_from_numpy(x, binary_data=binary)
    tensor = parse_infer_request(*client_body([item])).inputs[0].tensor
    assert tuple(tensor.shape) == shape
    body, header_length = encode_infer_response(model_name="m", model_version="1",
                                                request_id=None, outputs=[("y", tensor, binary)])
    back = th.InferResult.from_response_body(body, header_length=header_length).as_numpy("y")
    np.testing.assert_array_equal(back.reshape(shape), x)
