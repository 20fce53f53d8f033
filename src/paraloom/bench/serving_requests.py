"""The requests every server of ``paraloom bench serving`` gets, and the checks of its answers.

One row of LeNet input, encoded once per server and transport: v2 JSON, v2 binary tensor data
(JSON header, then the raw bytes) and a serialized gRPC ``ModelInferRequest``. Each server's
answer to one of them is compared with the model's own output before it is measured.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import numpy as np
import torch

__all__ = ["GRPC_INFER", "check_grpc", "grpc_request", "matches", "post_json", "v2_binary",
           "v2_json"]

GRPC_INFER = "/inference.GRPCInferenceService/ModelInfer"


def post_json(url: str, body: bytes, timeout: float = 30.0) -> Any:
    """POST ``body`` as JSON; the server's JSON answer, whatever its shape."""
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def v2_json(x: torch.Tensor) -> bytes:
    """A v2 inference request with ``x`` as JSON data."""
    return json.dumps({"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32",
                                   "data": x.flatten().tolist()}]}).encode()


def v2_binary(x: torch.Tensor) -> tuple[bytes, int]:
    """A v2 inference request with ``x`` as binary tensor data, and its JSON header's length
    (the ``Inference-Header-Content-Length``); the outputs come back binary too."""
    head = json.dumps({"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32",
                                   "parameters": {"binary_data_size": x.numel() * 4}}],
                       "parameters": {"binary_data_output": True}}).encode()
    return head + x.numpy().astype("<f4").tobytes(), len(head)


def grpc_request(x: torch.Tensor, model: str = "lenet", region: str | None = None,
                 request_id: str = "") -> bytes:
    """A serialized ``ModelInferRequest`` for ``model`` with ``x`` as raw contents, or naming
    the shared memory ``region`` that holds it."""
    from paraloom.serving.grpc.messages import message

    request = message("ModelInferRequest")(model_name=model, id=request_id)
    tensor = request.inputs.add(name="input", datatype="FP32", shape=list(x.shape))
    if region is None:
        request.raw_input_contents.append(x.numpy().astype("<f4").tobytes())
    else:
        tensor.parameters["shared_memory_region"].string_param = region
        tensor.parameters["shared_memory_byte_size"].int64_param = x.numel() * 4
    return bytes(request.SerializeToString())


def check_grpc(port: int, body: bytes, expected: torch.Tensor) -> bool:
    """Whether the gRPC server on ``port`` answers ``body`` with ``expected``."""
    import grpc

    from paraloom.serving.grpc.messages import message

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        raw = channel.unary_unary(GRPC_INFER)(body, timeout=30)
    response = message("ModelInferResponse").FromString(raw)
    if response.raw_output_contents:
        got = np.frombuffer(response.raw_output_contents[0], dtype="<f4")
    else:
        got = np.asarray(response.outputs[0].contents.fp32_contents, dtype=np.float32)
    return bool(np.allclose(got.reshape(tuple(expected.shape)), expected.numpy(), atol=1e-5))


def matches(data: object, expected: torch.Tensor) -> bool:
    """Whether JSON ``data`` (a server's answer) holds ``expected``'s values."""
    got = torch.tensor(data, dtype=torch.float32).reshape(expected.shape)
    return bool(torch.allclose(got, expected, atol=1e-5))
