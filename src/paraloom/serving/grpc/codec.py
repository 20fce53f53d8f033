"""ModelInferRequest -> ``InferRequest`` and ``InferAnswer`` -> ModelInferResponse.

The tensors are decoded by the same functions as HTTP's (``paraloom.serving.protocol`` and
``datatypes``), so both transports accept and refuse the same inputs with the same messages.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from paraloom.serving.datatypes import DataType, datatype_of, lookup, tensor_to_bytes
from paraloom.serving.errors import ProtocolError
from paraloom.serving.grpc.messages import (
    InferRequestMessage,
    InputTensor,
    Message,
    OutputRequest,
    Parameter,
    message,
)
from paraloom.serving.handling import InferAnswer
from paraloom.serving.protocol import (
    InferRequest,
    RequestedOutput,
    RequestInput,
    binary_input,
    json_input,
    parse_shape,
)

__all__ = ["ParameterValue", "decode_infer_request", "encode_infer_response", "parameter_value",
           "parameter_values"]

ParameterValue = bool | int | float | str | bytes | None
"""What one parameter holds: the field its oneof chose (None: none was set)."""

# The typed contents field each datatype's values travel in (FP16 and BF16 have none: raw only).
_FIELD = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents",
          "INT32": "int_contents", "INT64": "int64_contents", "UINT8": "uint_contents",
          "UINT16": "uint_contents", "UINT32": "uint_contents", "UINT64": "uint64_contents",
          "FP32": "fp32_contents", "FP64": "fp64_contents"}
_NUMPY = {"bool_contents": np.bool_, "int_contents": np.int32, "int64_contents": np.int64,
          "uint_contents": np.uint32, "uint64_contents": np.uint64, "fp32_contents": np.float32,
          "fp64_contents": np.float64}
_CONTENTS = [*_NUMPY, "bytes_contents"]
_Response = message("ModelInferResponse")


def parameter_value(param: Parameter) -> ParameterValue:
    """The Python value of an ``InferParameter`` or ``ModelRepositoryParameter``."""
    which = param.WhichOneof("parameter_choice")
    if which is None:
        return None
    value: ParameterValue = getattr(param, which)
    return value


def parameter_values(params: Mapping[str, Parameter]) -> dict[str, ParameterValue]:
    """The Python values of a message's ``parameters`` map."""
    return {k: parameter_value(v) for k, v in params.items()}


def _typed(tensor: InputTensor, dt: DataType, shape: tuple[int, ...], where: str
           ) -> torch.Tensor:
    used = [f for f in _CONTENTS if len(getattr(tensor.contents, f))]
    field = _FIELD.get(dt.name)
    if field is None:
        raise ProtocolError(f"{where} is {dt.name}, which has no typed contents field in the "
                            "protocol; send it in raw_input_contents (tritonclient.grpc does)")
    wrong = [f for f in used if f != field]
    if wrong:
        raise ProtocolError(f"{where} is {dt.name} but its values are in {wrong}; send "
                            f"{dt.name} values in contents.{field}")
    values: np.ndarray = np.asarray(getattr(tensor.contents, field), dtype=_NUMPY[field])
    return json_input(tensor.name, dt, shape, values)


def _input(tensor: InputTensor, index: int, raw: list[bytes] | None) -> RequestInput:
    if not tensor.name:
        raise ProtocolError(f"inputs[{index}] has no name; the v2 protocol requires it")
    where = f"input {tensor.name!r}"
    shape = parse_shape(list(tensor.shape), where)
    dt = lookup(tensor.datatype, where)
    if raw is None:
        return RequestInput(tensor.name, dt.name, shape, _typed(tensor, dt, shape, where))
    if tensor.HasField("contents"):
        raise ProtocolError(f"{where} has typed contents but the request also carries "
                            "raw_input_contents; send every input one way")
    chunk = memoryview(raw[index])
    return RequestInput(tensor.name, dt.name, shape,
                        binary_input(tensor.name, dt, shape, chunk, len(chunk)))


def decode_infer_request(request: InferRequestMessage) -> InferRequest:
    """The ``InferRequest`` a ModelInferRequest carries; ``ProtocolError`` if it is malformed."""
    if not request.inputs:
        raise ProtocolError("request has no inputs; send at least one tensor")
    raw = list(request.raw_input_contents) or None
    if raw is not None and len(raw) != len(request.inputs):
        raise ProtocolError(f"request has {len(request.inputs)} inputs but "
                            f"{len(raw)} raw_input_contents; send one raw entry per input, "
                            "in order, or typed contents for all")
    inputs = [_input(t, i, raw) for i, t in enumerate(request.inputs)]
    names = [t.name for t in inputs]
    if len(set(names)) != len(names):
        raise ProtocolError(f"request names an input more than once: {names}")
    params = parameter_values(request.parameters)
    return InferRequest(id=request.id or None, inputs=inputs,
                        outputs=_requested_outputs(request.outputs),
                        binary_output=_raw_output(params, raw is not None), parameters=params)


def _requested_outputs(requested: Sequence[OutputRequest]) -> list[RequestedOutput] | None:
    """The outputs a request names; None (every output) when it names none."""
    if not requested:
        return None
    outputs = []
    for i, out in enumerate(requested):
        if not out.name:
            raise ProtocolError(f"outputs[{i}] has no name")
        if "classification" in out.parameters:
            raise ProtocolError(f"output {out.name!r} asks for classification, an "
                                "extension paraloom does not implement; request the raw "
                                "output instead")
        outputs.append(RequestedOutput(out.name, None))
    return outputs


def _raw_output(params: Mapping[str, ParameterValue], raw_inputs: bool) -> bool:
    """Raw outputs for raw inputs, typed for typed; ``binary_data_output`` (bool) decides."""
    asked = params.get("binary_data_output")
    if asked is None:
        return raw_inputs
    if not isinstance(asked, bool):
        raise ProtocolError(f"request parameter binary_data_output is {asked!r}; expected a "
                            "bool (true: raw_output_contents, false: typed contents)")
    return asked


def encode_infer_response(answer: InferAnswer) -> Message:
    """A ModelInferResponse: outputs in ``raw_output_contents`` (what tritonclient.grpc's raw
    inputs get, as from Triton), or in typed contents when the request asked for them
    (typed inputs, or ``binary_data_output: false``) and every output has a typed field."""
    response = _Response(model_name=answer.model_name, model_version=answer.model_version,
                         id=answer.request_id or "")
    names = [datatype_of(tensor.dtype) for _, tensor, _ in answer.outputs]
    raw = any(binary for _, _, binary in answer.outputs) or any(n not in _FIELD for n in names)
    for (name, tensor, _), datatype in zip(answer.outputs, names, strict=True):
        out = response.outputs.add(name=name, datatype=datatype, shape=list(tensor.shape))
        if raw:  # all or none: raw_output_contents is matched to the outputs by position
            response.raw_output_contents.append(tensor_to_bytes(tensor))
        else:
            values = tensor.detach().cpu().contiguous().numpy().ravel()
            getattr(out.contents, _FIELD[datatype]).extend(values.tolist())
    return response

