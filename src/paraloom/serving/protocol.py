"""Open Inference Protocol (v2) codec: request and response bodies, JSON and binary tensors.

Pure functions over bytes and tensors; no HTTP here. Every problem with a request raises
``ProtocolError`` (HTTP 400) with a message that says what was wrong, what was expected and how
to fix it.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, NamedTuple, TypedDict, TypeVar, overload

if TYPE_CHECKING:  # typing has NotRequired from Python 3.11 on
    from typing_extensions import NotRequired

import torch

from paraloom.serving.classification import classes_asked
from paraloom.serving.datatypes import (
    DataType,
    Value,
    lookup,
    tensor_from_array,
    tensor_from_bytes,
    tensor_from_json,
    value_datatype,
    value_to_bytes,
    value_to_json,
)
from paraloom.serving.errors import ProtocolError, short_repr
from paraloom.serving.shared_memory import (
    ReadBudget,
    RegionRef,
    SharedMemoryRegistry,
    region_ref,
    registry_or_refuse,
)
from paraloom.serving.strings import BYTES, strings_from_buffer, strings_from_json

__all__ = [
    "AnswerOutput",
    "load_json",
    "InferRequest",
    "RequestInput",
    "RequestedOutput",
    "binary_input",
    "encode_infer_response",
    "json_input",
    "parse_infer_request",
    "parse_shape",
    "raw_value",
    "read_region",
    "MAX_STRING_REGION_BYTES",
]

MAX_STRING_REGION_BYTES = 16 << 20
"""The most bytes of a BYTES input read from shared memory: each string becomes a Python
object, so this bounds the work and memory one request can ask for (numbers have no such cost:
they are read straight into their tensor)."""


try:  # orjson parses a request's floats ~9x faster than json: it sets the server's throughput
    import orjson

    def _loads(data: bytes) -> object:
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            if b"NaN" not in data and b"Infinity" not in data:
                raise
        return _loads_nonfinite(data)

    def _dumps(obj: object, nonfinite: bool = False) -> bytes:
        return _dumps_nonfinite(obj) if nonfinite else orjson.dumps(obj)

except ImportError:  # pragma: no cover - the same results, slower

    def _loads(data: bytes) -> object:
        return _loads_nonfinite(data)

    def _dumps(obj: object, nonfinite: bool = False) -> bytes:
        return _dumps_nonfinite(obj)


def load_json(data: bytes) -> object:
    """A request body's JSON (``ValueError`` if it is none): ``NaN`` and ``Infinity`` read as
    numbers, as Triton reads them; a lone UTF-16 surrogate escape is refused, as orjson refuses
    it, for it is no text (a string holding one fails wherever it is encoded later)."""
    return _loads(data)


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _loads_nonfinite(data: bytes) -> object:
    """JSON with ``NaN``, ``Infinity`` and ``-Infinity`` as numbers, as Triton reads and writes
    them (and tritonclient, through Python's json, sends them); orjson refuses them."""
    try:
        obj = json.loads(data)
    except RecursionError as e:
        raise ValueError("the JSON is nested too deeply") from e
    if _SURROGATE_ESCAPE.search(data):  # a pair (an escaped emoji) reads as one character
        try:
            json.dumps(obj, ensure_ascii=False).encode()
        except UnicodeEncodeError as e:
            raise ValueError("a string holds a lone UTF-16 surrogate (an escape \\ud800 to "
                             "\\udfff that is not one of a pair), which is no text") from e
    return obj


def _dumps_nonfinite(obj: object) -> bytes:
    """``obj`` as JSON, with non-finite floats written as Triton does (``NaN``, ``Infinity``,
    ``-Infinity``; orjson would write ``null``, which reads back as NaN, sign lost)."""
    return json.dumps(obj, separators=(",", ":")).encode()


@dataclass
class RequestInput:
    """One decoded input of an inference request (a BYTES input: a numpy array of bytes)."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    tensor: Value


@dataclass
class RequestedOutput:
    """An output the client asked for; ``binary`` None means 'as the request default says';
    ``region``: write it into this shared memory region instead of the response."""

    name: str
    binary: bool | None = None
    region: RegionRef | None = None
    classes: int = 0
    """Triton's classification extension: the top this many classes, as strings (0: off)."""


class AnswerOutput(NamedTuple):
    """One output to send: its name and value, whether as binary data, and the shared memory
    region it goes to instead (None: in the response)."""

    name: str
    value: Value
    binary: bool
    region: RegionRef | None = None


@dataclass
class InferRequest:
    """A decoded inference request."""

    id: str | None
    inputs: list[RequestInput]
    outputs: list[RequestedOutput] | None = None
    binary_output: bool = False
    parameters: Mapping[str, object] = field(default_factory=dict)


class _OutputEntry(TypedDict):
    """One output of an inference response: JSON ``data``, ``binary_data_size`` bytes, or the
    shared memory region it was written to."""

    name: str
    datatype: str
    shape: list[int]
    parameters: NotRequired[dict[str, int | str]]
    data: NotRequired[list[int | float] | list[str]]


class _InferResponse(TypedDict):
    """An inference response body (its JSON part)."""

    model_name: str
    model_version: str
    outputs: list[_OutputEntry]
    id: NotRequired[str]


_T = TypeVar("_T")


@overload
def _get(obj: Mapping[str, object], key: str, kind: type[_T], where: str,
         required: Literal[True] = ...) -> _T: ...
@overload
def _get(obj: Mapping[str, object], key: str, kind: type[_T], where: str,
         required: bool) -> _T | None: ...
def _get(obj: Mapping[str, object], key: str, kind: type[_T], where: str,
         required: bool = True) -> _T | None:
    """``obj[key]`` if it is a ``kind`` (a bool is no int here); None if absent and optional."""
    value = obj.get(key)
    if value is None:
        if required:
            raise ProtocolError(f"{where} has no {key!r} field; the v2 protocol requires it")
        return None
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise ProtocolError(f"{where} field {key!r} must be {_kind_name(kind)}, got "
                            f"{type(value).__name__} {short_repr(value)}")
    return value


def _kind_name(kind: type) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
             int: "an integer"}
    return names.get(kind, kind.__name__)


_MAX_RANK = 32  # numpy's limit is 64; no model takes more
_MAX_ELEMENTS = 1 << 40  # far beyond any body; keeps byte strides inside 64 bits


def parse_shape(raw: object, where: str) -> tuple[int, ...]:
    if not isinstance(raw, list) or not all(isinstance(d, int) and not isinstance(d, bool)
                                            and d >= 0 for d in raw):
        raise ProtocolError(f"{where} has shape {short_repr(raw)}; expected an array of "
                            "non-negative integers such as [1, 1, 8, 8]")
    if len(raw) > _MAX_RANK:
        raise ProtocolError(f"{where} has a shape of {len(raw)} dimensions; expected at most "
                            f"{_MAX_RANK}; send the tensor with fewer dimensions")
    if math.prod(d for d in raw if d) > _MAX_ELEMENTS:
        raise ProtocolError(f"{where} has shape {short_repr(raw)}, whose dimensions multiply to "
                            f"more than {_MAX_ELEMENTS} elements (zero-size ones left out); "
                            "expected a shape that fits in memory, with the batch first")
    return tuple(raw)


def _build_tensor(build: Callable[..., torch.Tensor], where: str, shape: tuple[int, ...],
                  *args: object) -> torch.Tensor:
    """Run a tensor constructor; numpy's and torch's own refusals become a 400."""
    try:
        return build(*args)
    except ProtocolError:
        raise
    except (ValueError, TypeError, RuntimeError, MemoryError, OverflowError) as e:
        raise ProtocolError(f"{where} cannot be built as a tensor of shape {list(shape)}: "
                            f"{type(e).__name__}: {e}; send a smaller shape with data that "
                            "matches it") from e


def read_region(regions: SharedMemoryRegistry | None, ref: RegionRef, name: str,
                datatype: str, shape: tuple[int, ...], budget: ReadBudget) -> Value:
    """The input ``name`` read from the shared memory region ``ref`` names, counted against
    the request's ``budget``."""
    where = f"input {name!r}"
    dt = None if datatype == BYTES else lookup(datatype, where)
    if dt is None and ref.byte_size > MAX_STRING_REGION_BYTES:
        raise ProtocolError(f"{where} names {ref.byte_size} bytes of strings in shared memory; "
                            f"at most {MAX_STRING_REGION_BYTES} bytes of strings are read from "
                            "a region per input: send fewer per request")
    expected = None if dt is None else math.prod(shape) * dt.itemsize
    if expected is not None and ref.byte_size != expected:
        raise ProtocolError(f"{where} has shared_memory_byte_size {ref.byte_size} but shape "
                            f"{list(shape)} of {datatype} needs {expected} bytes")
    registry = registry_or_refuse(regions, f"{where} names shared memory region "
                                           f"{ref.region!r}, but ")
    budget.take(ref.byte_size, where)
    data = registry.read(ref, where)
    if dt is None:
        return strings_from_buffer(data.data, shape, where)
    return _build_tensor(tensor_from_array, where, shape, data, dt, shape)


def _parse_input(obj: object, index: int, binary: memoryview | None, offset: int,
                 regions: SharedMemoryRegistry | None, budget: ReadBudget
                 ) -> tuple[RequestInput, int]:
    if not isinstance(obj, dict):
        raise ProtocolError(f"inputs[{index}] must be an object with name, shape, datatype and "
                            f"data, got {short_repr(obj)}")
    name = _get(obj, "name", str, f"inputs[{index}]")
    where = f"input {name!r}"
    shape = parse_shape(obj.get("shape"), where)
    dt = None if obj.get("datatype") == BYTES else lookup(obj.get("datatype"), where)
    datatype = BYTES if dt is None else dt.name
    params = _get(obj, "parameters", dict, where, required=False) or {}
    ref = region_ref(params, where)
    if ref is not None:
        if "data" in obj or "binary_data_size" in params:
            raise ProtocolError(f"{where} names shared memory region {ref.region!r} and also "
                                "carries its data ('data' or binary_data_size); send it one way")
        return RequestInput(name, datatype, shape,
                            read_region(regions, ref, name, datatype, shape, budget)), 0
    size = params.get("binary_data_size")
    if size is None:
        if "data" not in obj:
            raise ProtocolError(f"{where} has neither 'data' nor parameters.binary_data_size; "
                                "send the values as JSON 'data' or as binary tensor data")
        value = (strings_from_json(obj["data"], shape, where) if dt is None
                 else json_input(name, dt, shape, obj["data"]))
        return RequestInput(name, datatype, shape, value), 0
    if "data" in obj:  # Triton refuses it too: which of the two is the input?
        raise ProtocolError(f"{where} has both 'data' and parameters.binary_data_size; send "
                            "its values one way")
    if binary is None:
        raise ProtocolError(f"{where} declares binary_data_size but the request has no "
                            "Inference-Header-Content-Length header giving the JSON length")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ProtocolError(f"{where} has binary_data_size {short_repr(size)}; expected a "
                            "non-negative integer")
    if dt is not None and size != math.prod(shape) * dt.itemsize:
        raise ProtocolError(f"{where} has binary_data_size {size} but shape {list(shape)} of "
                            f"{dt.name} needs {math.prod(shape) * dt.itemsize} bytes")
    if offset + size > len(binary):
        raise ProtocolError(f"{where} needs bytes {offset}..{offset + size} of the binary data "
                            f"but the body has only {len(binary)} bytes after the JSON header")
    value = raw_value(name, datatype, shape, binary[offset:offset + size])
    return RequestInput(name, datatype, shape, value), size


def json_input(name: str, dt: DataType, shape: tuple[int, ...], data: object) -> torch.Tensor:
    """The tensor of an input sent as values (JSON ``data``, or gRPC's typed contents)."""
    where = f"input {name!r}"
    return _build_tensor(tensor_from_json, where, shape, data, dt, shape, where)


def raw_value(name: str, datatype: str, shape: tuple[int, ...], chunk: memoryview) -> Value:
    """An input sent as raw bytes (binary extension, gRPC raw contents): length-prefixed
    strings for BYTES, little-endian numbers otherwise."""
    if datatype == BYTES:
        return strings_from_buffer(chunk, shape, f"input {name!r}")
    return binary_input(name, lookup(datatype, f"input {name!r}"), shape, chunk, len(chunk))


def binary_input(name: str, dt: DataType, shape: tuple[int, ...],
                 chunk: memoryview | bytearray, size: int) -> torch.Tensor:
    """The tensor of an input sent as raw bytes (binary extension, gRPC raw contents)."""
    where = f"input {name!r}"
    expected = math.prod(shape) * dt.itemsize
    if size != expected:
        raise ProtocolError(f"{where} has {size} bytes of binary data but shape {list(shape)} "
                            f"of {dt.name} needs {expected} bytes")
    return _build_tensor(tensor_from_bytes, where, shape, chunk, dt, shape)


def _split_body(body: bytes, header_length: int | None) -> tuple[object, memoryview | None]:
    view = memoryview(body)
    if header_length is None:
        head, binary = view, None
    elif header_length < 0 or header_length > len(body):
        raise ProtocolError(f"Inference-Header-Content-Length is {header_length} but the body "
                            f"has {len(body)} bytes; it must give the length of the JSON part")
    else:
        head, binary = view[:header_length], view[header_length:]
    try:
        return _loads(bytes(head)), binary
    except (UnicodeDecodeError, ValueError) as e:  # orjson's and json's errors are ValueErrors
        hint = ("" if header_length is not None else "; if the body carries binary tensors, "
                "send the Inference-Header-Content-Length header")
        raise ProtocolError(f"request body is not valid JSON: {e}{hint}") from e


def _parse_outputs(raw: object) -> list[RequestedOutput] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise ProtocolError(f"'outputs' must be an array of {{\"name\": ...}} objects, "
                            f"got {short_repr(raw)}")
    if not raw:  # as Triton, and as gRPC's empty repeated field: every output
        return None
    outputs = []
    for i, obj in enumerate(raw):
        if not isinstance(obj, dict):
            raise ProtocolError(f"outputs[{i}] must be an object with a name, got "
                                f"{short_repr(obj)}")
        name = _get(obj, "name", str, f"outputs[{i}]")
        params = _get(obj, "parameters", dict, f"output {name!r}", required=False) or {}
        binary = _get(params, "binary_data", bool, f"output {name!r} parameters", False)
        outputs.append(RequestedOutput(name, binary, region_ref(params, f"output {name!r}"),
                                       classes_asked(params.get("classification"),
                                                     f"output {name!r}")))
    return outputs


def parse_infer_request(body: bytes, header_length: int | None = None,
                        regions: SharedMemoryRegistry | None = None) -> InferRequest:
    """Decode a v2 inference request body (JSON, or JSON then binary tensor data); inputs in
    shared memory are read from ``regions`` (None: shared memory is off)."""
    obj, binary = _split_body(body, header_length)
    if not isinstance(obj, dict):
        raise ProtocolError(f"request body must be a JSON object with 'inputs', got "
                            f"{type(obj).__name__}")
    raw_inputs = _get(obj, "inputs", list, "request")
    if not raw_inputs:
        raise ProtocolError("request has an empty 'inputs' array; send at least one tensor")
    inputs, offset, budget = [], 0, ReadBudget(regions)
    for i, raw in enumerate(raw_inputs):
        item, used = _parse_input(raw, i, binary, offset, regions, budget)
        inputs.append(item)
        offset += used
    names = [t.name for t in inputs]
    if len(set(names)) != len(names):
        raise ProtocolError(f"request names an input more than once: {names}")
    if binary is not None and offset != len(binary):
        raise ProtocolError(f"body has {len(binary)} bytes after the JSON header but the inputs "
                            f"declare {offset}; check Inference-Header-Content-Length and each "
                            "binary_data_size")
    params = _get(obj, "parameters", dict, "request", required=False) or {}
    binary_output = _get(params, "binary_data_output", bool, "request parameters", False)
    request_id = obj.get("id")
    if isinstance(request_id, (dict, list)):
        raise ProtocolError(f"request id must be a string; got a JSON "
                            f"{'object' if isinstance(request_id, dict) else 'array'}")
    return InferRequest(id=None if request_id is None else str(request_id), inputs=inputs,
                        outputs=_parse_outputs(obj.get("outputs")),
                        binary_output=bool(binary_output), parameters=params)


def region_parameters(ref: RegionRef, size: int) -> dict[str, int | str]:
    """An output's parameters when it went to shared memory: the region and bytes written."""
    params: dict[str, int | str] = {"shared_memory_region": ref.region,
                                    "shared_memory_byte_size": size}
    if ref.offset:
        params["shared_memory_offset"] = ref.offset
    return params


def encode_infer_response(*, model_name: str, model_version: str, request_id: str | None,
                          outputs: Sequence[AnswerOutput | tuple[str, Value, bool]]
                          ) -> tuple[bytes, int | None]:
    """Encode the outputs (``AnswerOutput``s, or ``(name, value, as_binary)``); returns the body
    and the JSON length.

    The JSON length is None when no output is binary (then the body is plain JSON) and must be
    sent as the Inference-Header-Content-Length header otherwise. An output with a region was
    written there already: the response says where, and carries no data for it.
    """
    entries: list[_OutputEntry] = []
    chunks: list[bytes] = []
    nonfinite = False
    for output in outputs:
        name, value, as_binary, region = AnswerOutput(*output)
        entry: _OutputEntry = {"name": name, "datatype": value_datatype(value),
                               "shape": list(value.shape)}
        if region is not None:
            entry["parameters"] = region_parameters(region, region.byte_size)
        elif as_binary:
            chunk = value_to_bytes(value)
            entry["parameters"] = {"binary_data_size": len(chunk)}
            chunks.append(chunk)
        else:
            entry["data"] = value_to_json(value, name)
            nonfinite = nonfinite or (isinstance(value, torch.Tensor) and value.is_floating_point()
                                      and not bool(torch.isfinite(value).all()))
        entries.append(entry)
    response: _InferResponse = {"model_name": model_name, "model_version": model_version,
                                "outputs": entries}
    if request_id is not None:
        response["id"] = request_id
    head = _dumps(response, nonfinite)
    if not chunks:
        return head, None
    return b"".join([head, *chunks]), len(head)
