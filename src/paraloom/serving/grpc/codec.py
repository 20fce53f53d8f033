"""ModelInferRequest -> ``InferRequest`` and ``InferAnswer`` -> ModelInferResponse.

The tensors are decoded by the same functions as HTTP's (``paraloom.serving.protocol`` and
``datatypes``), so both transports accept and refuse the same inputs with the same messages.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from paraloom.serving.classification import classes_asked
from paraloom.serving.datatypes import Value, lookup, value_datatype, value_to_bytes
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
    json_input,
    parse_shape,
    raw_value,
    read_region,
    region_parameters,
)
from paraloom.serving.shared_memory import ReadBudget, SharedMemoryRegistry, region_ref
from paraloom.serving.strings import (
    BYTES,
    strings_from_list,
    strings_to_list,
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


def _typed(tensor: InputTensor, datatype: str, shape: tuple[int, ...], where: str) -> Value:
    used = [f for f in _CONTENTS if len(getattr(tensor.contents, f))]
    field = "bytes_contents" if datatype == BYTES else _FIELD.get(datatype)
    if field is None:
        raise ProtocolError(f"{where} is {datatype}, which has no typed contents field in the "
                            "protocol; send it in raw_input_contents (tritonclient.grpc does)")
    wrong = [f for f in used if f != field]
    if wrong:
        raise ProtocolError(f"{where} is {datatype} but its values are in {wrong}; send "
                            f"{datatype} values in contents.{field}")
    if datatype == BYTES:
        return strings_from_list(list(tensor.contents.bytes_contents), shape, where)
    values: np.ndarray = np.asarray(getattr(tensor.contents, field), dtype=_NUMPY[field])
    return json_input(tensor.name, lookup(datatype, where), shape, values)


def _input(tensor: InputTensor, index: int, raw: Iterator[bytes] | None,
           regions: SharedMemoryRegistry | None, budget: ReadBudget) -> RequestInput:
    if not tensor.name:
        raise ProtocolError(f"inputs[{index}] has no name; the v2 protocol requires it")
    where = f"input {tensor.name!r}"
    shape = parse_shape(list(tensor.shape), where)
    datatype = tensor.datatype if tensor.datatype == BYTES else lookup(tensor.datatype,
                                                                       where).name
    ref = region_ref(parameter_values(tensor.parameters), where)
    if ref is not None:
        if tensor.HasField("contents"):
            raise ProtocolError(f"{where} names shared memory region {ref.region!r} and also "
                                "carries typed contents; send it one way")
        value = read_region(regions, ref, tensor.name, datatype, shape, budget)
        return RequestInput(tensor.name, datatype, shape, value)
    if raw is None:
        return RequestInput(tensor.name, datatype, shape, _typed(tensor, datatype, shape, where))
    if tensor.HasField("contents"):
        raise ProtocolError(f"{where} has typed contents but the request also carries "
                            "raw_input_contents; send every input one way")
    value = raw_value(tensor.name, datatype, shape, memoryview(next(raw)))
    return RequestInput(tensor.name, datatype, shape, value)


def decode_infer_request(request: InferRequestMessage,
                         regions: SharedMemoryRegistry | None = None) -> InferRequest:
    """The ``InferRequest`` a ModelInferRequest carries; ``ProtocolError`` if it is malformed.
    Inputs in shared memory are read from ``regions`` (None: shared memory is off); they have
    no entry in ``raw_input_contents``, which holds the other inputs' bytes in order."""
    if not request.inputs:
        raise ProtocolError("request has no inputs; send at least one tensor")
    raw = list(request.raw_input_contents) or None
    in_memory = sum("shared_memory_region" in t.parameters for t in request.inputs)
    if raw is not None and len(raw) != len(request.inputs) - in_memory:
        raise ProtocolError(f"request has {len(request.inputs) - in_memory} inputs outside "
                            f"shared memory but {len(raw)} raw_input_contents; send one raw "
                            "entry per such input, in order, or typed contents for all")
    entries = None if raw is None else iter(raw)
    budget = ReadBudget(regions)
    inputs = [_input(t, i, entries, regions, budget) for i, t in enumerate(request.inputs)]
    names = [t.name for t in inputs]
    if len(set(names)) != len(names):
        raise ProtocolError(f"request names an input more than once: {names}")
    params = parameter_values(request.parameters)
    return InferRequest(id=request.id or None, inputs=inputs,
                        outputs=_requested_outputs(request.outputs),
                        binary_output=_raw_output(params, raw is not None or in_memory > 0),
                        parameters=params)


def _requested_outputs(requested: Sequence[OutputRequest]) -> list[RequestedOutput] | None:
    """The outputs a request names; None (every output) when it names none."""
    if not requested:
        return None
    outputs = []
    for i, out in enumerate(requested):
        if not out.name:
            raise ProtocolError(f"outputs[{i}] has no name")
        params = parameter_values(out.parameters)
        where = f"output {out.name!r}"
        outputs.append(RequestedOutput(out.name, None, region_ref(params, where),
                                       classes_asked(params.get("classification"), where)))
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


def _set_parameters(target: Mapping[str, Parameter], values: Mapping[str, int | str]) -> None:
    for key, value in values.items():
        param = target[key]  # a protobuf map makes the entry on first access
        if isinstance(value, str):
            param.string_param = value  # type: ignore[attr-defined]
        else:
            param.int64_param = value  # type: ignore[attr-defined]


def encode_infer_response(answer: InferAnswer) -> Message:
    """A ModelInferResponse: outputs in ``raw_output_contents`` (what tritonclient.grpc's raw
    inputs get, as from Triton), or in typed contents when the request asked for them
    (typed inputs, or ``binary_data_output: false``) and every output has a typed field.
    An output written to shared memory carries its region in its parameters, and an empty
    raw entry (raw entries are matched to the outputs by position)."""
    response = _Response(model_name=answer.model_name, model_version=answer.model_version,
                         id=answer.request_id or "")
    names = [value_datatype(out.value) for out in answer.outputs]
    raw = any(out.binary for out in answer.outputs) or any(
        n not in _FIELD and n != BYTES for n in names)
    for out, datatype in zip(answer.outputs, names, strict=True):
        entry = response.outputs.add(name=out.name, datatype=datatype,
                                     shape=list(out.value.shape))
        if out.region is not None:
            _set_parameters(entry.parameters, region_parameters(out.region,
                                                                out.region.byte_size))
            if raw:
                response.raw_output_contents.append(b"")
        elif raw:  # all or none: raw_output_contents is matched to the outputs by position
            response.raw_output_contents.append(value_to_bytes(out.value))
        elif isinstance(out.value, np.ndarray):  # BYTES
            entry.contents.bytes_contents.extend(strings_to_list(out.value))
        else:
            values = out.value.detach().cpu().contiguous().numpy().ravel()
            getattr(entry.contents, _FIELD[datatype]).extend(values.tolist())
    return response
