"""The v2 datatypes, and one tensor to and from the wire: JSON data or little-endian bytes."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, replace

import numpy as np
import torch

from paraloom.serving.errors import ProtocolError, short_repr
from paraloom.serving.strings import BYTES, is_strings, strings_to_buffer, strings_to_json

Value = torch.Tensor | np.ndarray
"""A tensor on the wire: a torch tensor, or a numpy array of ``bytes`` for a BYTES tensor."""

__all__ = [
    "DATATYPES",
    "DataType",
    "datatype_of",
    "lookup",
    "tensor_from_array",
    "tensor_from_bytes",
    "tensor_from_json",
    "tensor_to_bytes",
    "tensor_to_json",
    "value_datatype",
    "value_to_bytes",
    "value_to_json",
]


@dataclass(frozen=True)
class DataType:
    """One v2 datatype: its torch dtype and its little-endian numpy dtype (None for BF16)."""

    name: str
    torch_dtype: torch.dtype
    numpy_dtype: np.dtype | None
    itemsize: int
    kinds: str  # numpy kinds accepted in JSON data ('b' bool, 'i'/'u' integers, 'f' floats):
    # as Triton, JSON true/false are BOOL's alone, and a number is no BOOL


def _dt(name: str, tdt: torch.dtype, npdt: str | None, kinds: str) -> DataType:
    np_dtype = np.dtype(npdt) if npdt else None
    itemsize = torch.empty((), dtype=tdt).element_size()
    return DataType(name, tdt, np_dtype, itemsize, kinds)


DATATYPES: dict[str, DataType] = {d.name: d for d in [
    _dt("BOOL", torch.bool, "|b1", "b"),
    _dt("UINT8", torch.uint8, "|u1", "iu"),
    _dt("UINT16", torch.uint16, "<u2", "iu"),
    _dt("UINT32", torch.uint32, "<u4", "iu"),
    _dt("UINT64", torch.uint64, "<u8", "iu"),
    _dt("INT8", torch.int8, "|i1", "iu"),
    _dt("INT16", torch.int16, "<i2", "iu"),
    _dt("INT32", torch.int32, "<i4", "iu"),
    _dt("INT64", torch.int64, "<i8", "iu"),
    _dt("FP16", torch.float16, "<f2", "iuf"),
    _dt("BF16", torch.bfloat16, None, "iuf"),
    _dt("FP32", torch.float32, "<f4", "iuf"),
    _dt("FP64", torch.float64, "<f8", "iuf"),
]}
_BY_TORCH = {d.torch_dtype: d for d in DATATYPES.values()}

_LITTLE = sys.byteorder == "little"


def datatype_of(dtype: torch.dtype) -> str:
    """The v2 datatype name of a torch dtype, e.g. ``torch.float32`` -> ``"FP32"``."""
    if dtype not in _BY_TORCH:
        raise TypeError(f"torch dtype {dtype} has no Open Inference Protocol datatype; "
                        f"supported: {', '.join(DATATYPES)}")
    return _BY_TORCH[dtype].name


def lookup(raw: object, where: str) -> DataType:
    """The numeric datatype a request names; ``ProtocolError`` for an unknown name (callers
    handle BYTES, which has no tensor dtype, before they get here)."""
    if not isinstance(raw, str) or raw not in DATATYPES:
        raise ProtocolError(f"{where} has unknown datatype {short_repr(raw)}; expected one of "
                            f"{', '.join(DATATYPES)} or {BYTES} (case-sensitive)")
    return DATATYPES[raw]


def tensor_from_json(data: object, dt: DataType, shape: tuple[int, ...], where: str
                     ) -> torch.Tensor:
    """A tensor from JSON ``data`` (flat or nested, row-major), checked against its datatype."""
    if dt.numpy_dtype is None:  # BF16
        # numpy has no bfloat16: read float64 (errors naming BF16), then let torch round them.
        given = tensor_from_json(data, replace(DATATYPES["FP64"], name="BF16"), shape, where)
        rounded = given.to(torch.bfloat16)
        _check_overflow(given.numpy(), rounded.float().numpy(), dt, where)
        return rounded
    count = math.prod(shape)
    if dt.kinds != "b" and _holds_bool(data):  # numpy reads [true, 7] as the numbers [1, 7]
        raise ProtocolError(f"{where} data holds boolean values, which datatype {dt.name} does "
                            "not accept")
    try:
        arr = np.asarray(data)
    except (ValueError, TypeError) as e:
        raise ProtocolError(f"{where} data is not a rectangular array of numbers: {e}") from e
    if count and arr.dtype.kind in "fO" and dt.kinds == "iu":
        arr = _exact_integers(data, arr, dt, where)
    if arr.size != count:
        raise ProtocolError(f"{where} has {arr.size} data elements but shape {list(shape)} "
                            f"needs {count}; send shape and data that agree")
    assert dt.numpy_dtype is not None
    if count:
        _check_values(arr, dt, dt.numpy_dtype, where)
    with np.errstate(over="ignore"):  # an overflow is looked for below, and refused by name
        cast = cast_keeping_gil(arr, dt.numpy_dtype)
    if count and dt.numpy_dtype.kind == "f":
        _check_overflow(arr, cast, dt, where)
    return torch.from_numpy(cast.reshape(shape))


def _holds_bool(data: object) -> bool:
    """Whether JSON ``data`` (nested lists, row-major) holds a ``true`` or ``false``."""
    if not isinstance(data, list):
        return isinstance(data, bool)
    if data and isinstance(data[0], list):
        return any(_holds_bool(row) for row in data)
    return bool in set(map(type, data))


def _check_values(arr: np.ndarray, dt: DataType, np_dtype: np.dtype, where: str
                  ) -> None:
    """``ProtocolError`` unless every value of ``arr`` is of a kind ``dt`` accepts and, for an
    integer datatype, within its range."""
    kind = arr.dtype.kind
    if kind == "f" and dt.kinds == "iu" and np.isfinite(arr).all() and (arr == arr // 1).all():
        _check_range(arr, dt, np.iinfo(np_dtype), where)  # integers past 2**64, read as floats
    if kind not in dt.kinds:
        raise ProtocolError(f"{where} data holds {_kind_word(kind)} values, which "
                            f"datatype {dt.name} does not accept")
    if np_dtype.kind in "iu":
        _check_range(arr, dt, np.iinfo(np_dtype), where)


def _check_overflow(given: np.ndarray, cast: np.ndarray, dt: DataType, where: str) -> None:
    """``ProtocolError`` if a finite value became infinite in ``dt`` (past FP16's 65504, or
    FP32's 3.4028235e38, once rounded); an Infinity sent stays one."""
    grew = np.isinf(cast.reshape(-1))  # the data's shape, or the request's (BF16)
    if grew.any():
        flat = given.reshape(-1)
        grew &= np.isfinite(flat)
        if grew.any():
            largest = float(torch.finfo(dt.torch_dtype).max)
            raise ProtocolError(f"{where} data has values such as {flat[grew][0]} "
                                f"that {dt.name} cannot hold (its largest is {largest:.8g}); send "
                                "smaller values, or a wider datatype")


def _check_range(arr: np.ndarray, dt: DataType, info: np.iinfo, where: str) -> None:
    low, high = arr.min(), arr.max()
    if low < info.min or high > info.max:
        raise ProtocolError(f"{where} data has values in [{low}, {high}], outside "
                            f"{dt.name}'s range [{info.min}, {info.max}]")


def _exact_integers(data: object, arr: np.ndarray, dt: DataType, where: str) -> np.ndarray:
    """JSON integers that numpy read as floats or objects (past int64's range, as UINT64's upper
    half, next to smaller ones) as ``dt``'s integers, exactly; ``arr`` if any is not an int."""
    try:
        values = np.asarray(data, dtype=object)
    except (ValueError, TypeError):
        return arr
    if values.shape != arr.shape or not all(type(v) is int for v in values.flat):
        return arr
    assert dt.numpy_dtype is not None
    info = np.iinfo(dt.numpy_dtype)
    low, high = min(values.flat), max(values.flat)
    if low < info.min or high > info.max:
        raise ProtocolError(f"{where} data has values in [{low}, {high}], outside "
                            f"{dt.name}'s range [{info.min}, {info.max}]")
    return np.array(values.ravel().tolist(), dtype=dt.numpy_dtype).reshape(arr.shape)


# numpy drops the GIL for a cast of more than this many elements (NPY_BEGIN_THREADS_THRESHOLDED)
_NUMPY_KEEPS_GIL = 500
_CAST_IN_CHUNKS = 1 << 15


def cast_keeping_gil(arr: np.ndarray, dtype: np.dtype[np.generic]) -> np.ndarray:
    """``arr`` as a new contiguous flat array of ``dtype``, cast in chunks numpy casts without
    dropping the GIL. On the event loop, a dropped GIL is taken back only when a worker thread
    yields it (up to the switch interval later): that wait, not the cast, was the cost."""
    flat = arr.reshape(-1)
    if flat.size > _CAST_IN_CHUNKS:  # a cast this long is worth handing the GIL on
        return flat.astype(dtype)
    out = np.empty(flat.size, dtype)
    for i in range(0, flat.size, _NUMPY_KEEPS_GIL):
        out[i:i + _NUMPY_KEEPS_GIL] = flat[i:i + _NUMPY_KEEPS_GIL]
    return out


def _kind_word(kind: str) -> str:
    return {"b": "boolean", "i": "integer", "u": "integer", "f": "floating-point",
            "U": "string", "S": "bytes", "O": "mixed or nested"}.get(kind, f"{kind!r}-kind")


def tensor_from_bytes(chunk: memoryview | bytearray, dt: DataType, shape: tuple[int, ...]
                      ) -> torch.Tensor:
    """A writable tensor from the binary extension's little-endian, row-major bytes (a
    ``bytearray`` is used as it is; other buffers are copied once: tensors must be writable)."""
    raw = chunk if isinstance(chunk, bytearray) else bytearray(chunk)
    if not raw:
        return torch.empty(shape, dtype=dt.torch_dtype)
    if dt.numpy_dtype is None or _LITTLE:
        flat = torch.frombuffer(raw, dtype=dt.torch_dtype)
    else:  # big-endian host: numpy swaps the bytes of the little-endian wire format
        flat = torch.from_numpy(np.frombuffer(raw, dtype=dt.numpy_dtype).astype(
            dt.numpy_dtype.newbyteorder("=")))
    return flat.reshape(shape)


def tensor_from_array(data: np.ndarray, dt: DataType, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor over ``data`` (a flat uint8 array of little-endian, row-major bytes, which the
    tensor takes over without a copy; on a big-endian host, a converted copy)."""
    if not _LITTLE and dt.numpy_dtype is not None:
        return tensor_from_bytes(bytearray(data.tobytes()), dt, shape)
    return torch.from_numpy(data).view(dt.torch_dtype).reshape(shape)


def tensor_to_bytes(t: torch.Tensor) -> bytes:
    """The binary extension's bytes of a tensor: little-endian, row-major, no padding."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)  # numpy has no bfloat16; the bits are what the wire carries
    arr = t.numpy()
    if not _LITTLE:
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return arr.tobytes()


def tensor_to_json(t: torch.Tensor) -> list[int | float]:
    """A tensor's values as a flat, row-major JSON list."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        t = t.float()
    values: list[int | float] = t.numpy().ravel().tolist()
    return values


def value_datatype(value: Value) -> str:
    """The v2 datatype of an output: a tensor's, or BYTES for an array of strings."""
    if isinstance(value, torch.Tensor):
        return datatype_of(value.dtype)
    if is_strings(value):
        return BYTES
    raise TypeError(f"an output of numpy dtype {value.dtype} should have been a tensor")


def value_to_bytes(value: Value) -> bytes:
    """An output's binary form (little-endian tensor bytes, or length-prefixed strings)."""
    if isinstance(value, torch.Tensor):
        return tensor_to_bytes(value)
    return strings_to_buffer(value)


def value_to_json(value: Value, name: str) -> list[int | float] | list[str]:
    """An output's values as a flat JSON list."""
    if isinstance(value, torch.Tensor):
        return tensor_to_json(value)
    return strings_to_json(value, name)
