"""The v2 ``BYTES`` datatype: tensors of strings, as numpy object arrays of ``bytes``.

On the wire (Triton's and tritonclient's form): in JSON, an array of strings; in binary data,
gRPC raw contents and shared memory, each element as its length in 4 little-endian bytes
followed by its bytes; in gRPC typed contents, ``bytes_contents``. Only models with a handler
(``paraloom.serving.handlers``) take or return them: torch models take numeric tensors.
"""

from __future__ import annotations

import math
import struct

import numpy as np

from paraloom.serving.errors import ProtocolError, short_repr

__all__ = ["BYTES", "is_strings", "strings_from_buffer", "strings_from_json",
           "strings_from_list", "strings_to_buffer", "strings_to_json", "strings_to_list"]

BYTES = "BYTES"
_LENGTH = struct.Struct("<I")


def is_strings(value: object) -> bool:
    """Whether ``value`` is a numpy array of strings or bytes (a BYTES tensor)."""
    return isinstance(value, np.ndarray) and value.dtype.kind in "OSU"


def _as_bytes(item: object, where: str) -> bytes:
    if isinstance(item, bytes):
        return item
    if isinstance(item, str):
        return item.encode("utf-8")
    raise ProtocolError(f"{where} is BYTES but holds {type(item).__name__} "
                        f"{short_repr(item)}; send strings")


def strings_from_list(items: list[object], shape: tuple[int, ...], where: str) -> np.ndarray:
    """A BYTES array of ``shape`` from a flat list of str or bytes."""
    count = math.prod(shape)
    if len(items) != count:
        raise ProtocolError(f"{where} has {len(items)} strings but shape {list(shape)} needs "
                            f"{count}; send shape and data that agree")
    out = np.empty(count, dtype=object)
    for i, item in enumerate(items):
        out[i] = _as_bytes(item, where)
    return out.reshape(shape)


def _flatten(data: object) -> list[object]:
    if not isinstance(data, list):
        return [data]
    flat: list[object] = []
    stack = [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            flat.append(item)
        else:
            stack.pop()
    return flat


def strings_from_json(data: object, shape: tuple[int, ...], where: str) -> np.ndarray:
    """A BYTES array from JSON ``data``: strings, flat or nested, row-major."""
    return strings_from_list(_flatten(data), shape, where)


def strings_from_buffer(buffer: bytes | bytearray | memoryview, shape: tuple[int, ...],
                        where: str) -> np.ndarray:
    """A BYTES array from length-prefixed elements; every byte of ``buffer`` must be used."""
    view = memoryview(buffer)
    count = math.prod(shape)
    if count * _LENGTH.size > len(view):  # before allocating: each string takes 4 bytes or more
        raise ProtocolError(f"{where} has {len(view)} bytes, too few for the {count} strings "
                            f"of shape {list(shape)}; each string is its length in 4 "
                            "little-endian bytes, then its bytes")
    out = np.empty(count, dtype=object)
    pos = 0
    for i in range(count):
        if pos + 4 > len(view):
            raise ProtocolError(f"{where} holds {i} strings in {len(view)} bytes but shape "
                                f"{list(shape)} needs {count}; each string is its length in 4 "
                                "little-endian bytes, then its bytes")
        (size,) = _LENGTH.unpack_from(view, pos)
        pos += 4
        if pos + size > len(view):
            raise ProtocolError(f"{where} string {i} says it has {size} bytes but only "
                                f"{len(view) - pos} remain; BYTES data is strings, each its "
                                "length in 4 little-endian bytes, then its bytes (numbers "
                                "take the model's datatype, e.g. FP32)")
        out[i] = bytes(view[pos:pos + size])
        pos += size
    if pos != len(view):
        raise ProtocolError(f"{where} has {len(view) - pos} bytes left after its {count} "
                            f"strings; shape {list(shape)} and the data disagree")
    return out.reshape(shape)


def strings_to_list(value: np.ndarray) -> list[bytes]:
    """The elements of a BYTES array as bytes (``str`` encoded as UTF-8), row-major."""
    return [item if isinstance(item, bytes) else str(item).encode("utf-8")
            for item in value.ravel().tolist()]


def strings_to_buffer(value: np.ndarray) -> bytes:
    """The length-prefixed bytes of a BYTES array (row-major)."""
    parts = []
    for data in strings_to_list(value):
        parts.append(_LENGTH.pack(len(data)))
        parts.append(data)
    return b"".join(parts)


def strings_to_json(value: np.ndarray, name: str) -> list[str]:
    """A BYTES array as a flat list of strings; UTF-8 is required for JSON."""
    out = []
    for item in value.ravel().tolist():
        if isinstance(item, bytes):
            try:
                item = item.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ProtocolError(f"output {name!r} holds bytes that are not UTF-8 text, "
                                    "which JSON cannot carry; request it as binary data "
                                    '("binary_data": true)') from e
        out.append(str(item))
    return out
