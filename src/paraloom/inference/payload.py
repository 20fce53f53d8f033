"""Pure functions over request inputs and model outputs: parse, key, collate, split, convert.

A request's input is a tensor, a numpy array, a tuple/list of them (the model's positional
inputs) or a dict of them (keyword inputs). Every tensor's first dimension is the request's rows.
Requests share a batch only if their *keys* are equal: the same structure and, per tensor, the
same shape after the first dimension, dtype and device.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple, TypeGuard, TypeVar

import numpy as np
import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from paraloom.data import _rebuild_mapping, dataclass_fields, map_tensors
from paraloom.inference.errors import InvalidRequestError

__all__ = ["Parsed", "UnsplittableOutputError", "parse", "one_example", "with_keywords",
           "describe_key", "collate", "call_model", "split_output", "split_rows", "map_tensors",
           "to_numpy", "to_device"]

# spec of a request's structure: None for one tensor, ("tuple"|"list", n) or ("dict", keys).
_ONE = None

# A model's output structure: moving its tensors gives the same structure back.
_Output = TypeVar("_Output")


class Parsed(NamedTuple):
    """A request's input taken apart: its tensors, structure, rows, batch key, numpy flag."""

    tensors: tuple[torch.Tensor, ...]
    spec: Hashable
    rows: int
    key: Hashable
    numpy: bool


def _as_tensor(x: object, where: str) -> tuple[torch.Tensor, bool]:
    if isinstance(x, torch.Tensor):
        return x, False
    if isinstance(x, np.ndarray):
        if not x.dtype.isnative:  # big-endian data (np.frombuffer(b, ">f4"), FITS): torch's order
            x = x.astype(x.dtype.newbyteorder("="))
        try:
            return torch.from_numpy(x), True  # zero copy; inputs are never written to
        except ValueError:  # negative strides (a reversed view): torch needs a copy
            return torch.from_numpy(np.ascontiguousarray(x)), True
        except TypeError as exc:
            raise InvalidRequestError(
                f"{where}: numpy dtype {x.dtype} has no torch equivalent; send a numeric array "
                "(float32, int64, bool, ...)", received=f"ndarray{x.shape} {x.dtype}") from exc
    raise InvalidRequestError(
        f"{where} is a {type(x).__name__}; expected a torch.Tensor or numpy.ndarray "
        "(a tuple/list of them for a multi-input model, or a dict for keyword inputs)",
        received=type(x).__name__)


def _rows(t: torch.Tensor, where: str) -> int:
    if t.dim() == 0:
        raise InvalidRequestError(
            f"{where} is a 0-d tensor; inputs need a first (batch) dimension, e.g. x.unsqueeze(0)",
            received="Tensor() " + _dtype_name(t.dtype))
    return int(t.shape[0])


def _signature(t: torch.Tensor) -> tuple[torch.Size, torch.dtype, torch.device]:
    return (t.shape[1:], t.dtype, t.device)


def _numbers(x: object) -> TypeGuard[list[float] | tuple[float, ...]]:
    return isinstance(x, (list, tuple)) and bool(x) and all(
        isinstance(v, numbers.Real) and not isinstance(v, bool) for v in x)


def _dtype_of(values: Iterable[object]) -> torch.dtype:
    """As ``torch.tensor`` infers it: int64 for whole numbers only (token ids), else the
    default float dtype."""
    if all(isinstance(v, numbers.Integral) for v in values):
        return torch.int64
    return torch.get_default_dtype()


def one_example(x: object) -> object:
    """``output()``'s single example: a list of numbers or a 1-D tensor/array is one row (as
    DL4J's ``output(float[])``), a list of such lists is rows; anything else is returned as
    it is. Whole numbers only give int64 (token ids), as ``torch.tensor`` does."""
    if _numbers(x):
        return torch.tensor([list(x)], dtype=_dtype_of(x))
    if isinstance(x, list) and x and all(_numbers(row) for row in x) \
            and len({len(row) for row in x}) == 1:
        return torch.tensor(x, dtype=_dtype_of(v for row in x for v in row))
    if isinstance(x, (torch.Tensor, np.ndarray)) and x.ndim == 1:
        return x[None]
    return x


def with_keywords(x: object, keywords: dict[str, object]) -> object:
    """The model's call as one input: positional ``x`` plus keyword inputs (masks...)."""
    if not keywords:
        return x
    positional = tuple(x) if isinstance(x, (tuple, list)) else (x,)
    return _Call(positional, keywords)


class _Call(NamedTuple):
    """Positional and keyword inputs of one call, e.g. ``model(x, mask=m)``."""

    args: tuple[object, ...]
    kwargs: dict[str, object]


def parse(x: object, aligned: bool = True) -> Parsed:
    """Take a request's input apart, or raise InvalidRequestError saying what is wrong.

    ``aligned``: every tensor's first dimension must be the same (the request's rows), as
    merging requests needs; else the rows are the first tensor's."""
    if isinstance(x, torch.Tensor) and x.dim() > 0:  # the fast path: one tensor
        rows = int(x.shape[0])
        if rows == 0:
            raise _empty("the input", x)
        return Parsed((x,), _ONE, rows, (_ONE, x.shape[1:], x.dtype, x.device), False)
    kind: str
    if _packed(x):
        raise InvalidRequestError(_PACKED, received="PackedSequence")
    if isinstance(x, _Call):
        names = [*(f"input[{i}]" for i in range(len(x.args))),
                 *(f"keyword input {k!r}" for k in x.kwargs)]
        spec: Hashable = ("call", len(x.args), tuple(x.kwargs))
        return _parse_many([*x.args, *x.kwargs.values()], names, spec, aligned)
    if isinstance(x, (tuple, list)):
        kind, names = type(x).__name__, [f"input[{i}]" for i in range(len(x))]
        spec = (kind, len(x))
        items = list(x)
    elif isinstance(x, Mapping):
        kind, names = "dict", [f"input[{k!r}]" for k in x]
        spec = (kind, tuple(x))
        items = list(x.values())
    else:
        t, is_np = _as_tensor(x, "the input")
        rows = _rows(t, "the input")
        if rows == 0:
            raise _empty("the input", t)
        return Parsed((t,), _ONE, rows, (_ONE, *_signature(t)), is_np)
    if not items:
        raise InvalidRequestError(f"the input is an empty {kind}; send at least one tensor",
                                  received=f"empty {kind}")
    return _parse_many(items, names, spec, aligned)


_PACKED = ("a PackedSequence cannot be split into rows or merged with other requests; send the "
           "padded batch (torch.nn.utils.rnn.pad_packed_sequence gives it) with its lengths, "
           "and pack it inside the model's forward")


def _packed(x: object) -> bool:
    """Whether a request is, or holds, a PackedSequence."""
    if isinstance(x, _Call):
        return any(_packed(v) for v in (*x.args, *x.kwargs.values()))
    if isinstance(x, Mapping):
        return any(isinstance(v, PackedSequence) for v in x.values())
    if isinstance(x, (tuple, list)):
        return isinstance(x, PackedSequence) or any(isinstance(v, PackedSequence) for v in x)
    return False


def _parse_many(items: list[object], names: list[str], spec: Hashable, aligned: bool
                ) -> Parsed:
    converted = [_as_tensor(v, n) for v, n in zip(items, names, strict=True)]
    tensors = tuple(t for t, _ in converted)
    rows = [_rows(t, n) for t, n in zip(tensors, names, strict=True)]
    if aligned and len(set(rows)) != 1:
        detail = ", ".join(f"{n}: {r}" for n, r in zip(names, rows, strict=True))
        raise InvalidRequestError(
            f"the inputs disagree on the number of rows ({detail}); every input's first "
            "dimension must be the same batch size", received=detail)
    if rows[0] == 0:
        raise _empty(names[0], tensors[0])
    key = (spec, tuple(_signature(t) for t in tensors))
    return Parsed(tensors, spec, rows[0], key, any(n for _, n in converted))


def _empty(where: str, t: torch.Tensor) -> InvalidRequestError:
    return InvalidRequestError(f"{where} has 0 rows; send at least one row",
                               received=_describe_tensor(t.shape[1:], t.dtype))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _describe_tensor(shape: Sequence[int], dtype: torch.dtype) -> str:
    return f"Tensor({', '.join(['N', *map(str, shape)])}) {_dtype_name(dtype)}"


def describe_key(key: Hashable) -> str:
    """A batch key as a short text, e.g. ``Tensor(N, 1, 28, 28) float32``."""
    assert isinstance(key, tuple)
    if key[0] is _ONE:
        return _describe_tensor(key[1], key[2])
    spec, sigs = key
    parts = [_describe_tensor(shape, dtype) for shape, dtype, _ in sigs]
    if spec[0] == "dict":
        return "{" + ", ".join(f"{k!r}: {p}" for k, p in zip(spec[1], parts, strict=True)) + "}"
    if spec[0] == "call":
        n = spec[1]
        named = [f"{k}={p}" for k, p in zip(spec[2], parts[n:], strict=True)]
        return f"call({', '.join([*parts[:n], *named])})"
    return f"{spec[0]}({', '.join(parts)})"


def key_kind(key: Hashable) -> Hashable:
    """A batch key without its sizes: how the inputs are passed, and each one's dtype and
    number of dimensions. Keys of one kind differ only in sizes (a sequence's length)."""
    assert isinstance(key, tuple)
    if key[0] is _ONE:
        return (_ONE, len(key[1]), key[2])
    spec, sigs = key
    return (spec, tuple((len(shape), dtype) for shape, dtype, _ in sigs))


def key_sizes(key: Hashable) -> tuple[int, ...]:
    """A batch key's sizes but the rows, every input's in turn (what ``key_kind`` leaves out)."""
    assert isinstance(key, tuple)
    if key[0] is _ONE:
        return tuple(key[1])
    return tuple(size for shape, _, _ in key[1] for size in shape)


def collate(batch: Sequence[tuple[torch.Tensor, ...]], device: torch.device) -> list[torch.Tensor]:
    """Concatenate the requests' tensors position by position (once) and move them to device."""
    if len(batch) == 1:
        merged = list(batch[0])
    else:
        merged = [torch.cat(parts) for parts in zip(*batch, strict=True)]
    return [t.to(device, non_blocking=True) for t in merged]


def call_model(model: nn.Module, spec: Hashable, tensors: Sequence[torch.Tensor]) -> Any:
    """Call the model: one tensor, positional inputs (tuple/list) or keyword inputs (dict)."""
    if spec is _ONE:
        return model(tensors[0])
    assert isinstance(spec, tuple)
    if spec[0] == "dict":
        return model(**dict(zip(spec[1], tensors, strict=True)))
    if spec[0] == "call":
        n = spec[1]
        return model(*tensors[:n], **dict(zip(spec[2], tensors[n:], strict=True)))
    return model(*tensors)


def split_output(output: Any, rows: Sequence[int]) -> list[Any]:
    """Split a batch's output back into one output per request, as views over the batch."""
    if len(rows) == 1:
        return [output]
    return split_rows(output, rows)


def split_rows(output: Any, rows: Sequence[int]) -> list[Any]:
    """``split_output`` that also checks a lone request's output: UnsplittableOutputError
    unless every tensor and array in it has the rows as its first dimension."""
    return _split(output, list(rows), sum(rows))


class UnsplittableOutputError(ValueError):
    """A merged batch's output has a tensor or array whose first dimension is not the batch."""


def _split(obj: Any, rows: list[int], total: int) -> list[Any]:
    if isinstance(obj, (torch.Tensor, np.ndarray)):
        if obj.ndim == 0 or obj.shape[0] != total:
            kind = "tensor" if isinstance(obj, torch.Tensor) else "numpy array"
            merged = f" merged from {len(rows)} requests" if len(rows) > 1 else ""
            raise UnsplittableOutputError(
                f"the model returned a {kind} of shape {tuple(obj.shape)} for {total} rows"
                f"{merged}; batched inference needs "
                "outputs whose first dimension is the batch (an LSTM's h_n is (layers, N, H): "
                "return h_n.transpose(0, 1)), or inference_mode='sequential'")
        if isinstance(obj, np.ndarray):
            return np.split(obj, np.cumsum(rows)[:-1])
        return list(torch.split(obj, rows))
    if isinstance(obj, (tuple, list)):
        columns = [_split(o, rows, total) for o in obj]
        per_request = [[col[i] for col in columns] for i in range(len(rows))]
        if hasattr(obj, "_fields"):
            return [type(obj)(*items) for items in per_request]
        return [type(obj)(items) for items in per_request]
    if isinstance(obj, Mapping):
        columns_by_key = {k: _split(v, rows, total) for k, v in obj.items()}
        return [_rebuild_mapping(obj, {k: col[i] for k, col in columns_by_key.items()})
                for i in range(len(rows))]
    if (fields := dataclass_fields(obj)) is not None:
        columns_by_name = {k: _split(v, rows, total) for k, v in fields.items()}
        return [dataclasses.replace(obj, **{k: col[i] for k, col in columns_by_name.items()})
                for i in range(len(rows))]
    return [obj] * len(rows)  # a non-tensor leaf (None, a label list...) goes to every request


def _numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    if t.dtype in (torch.bfloat16,):  # numpy has no bfloat16
        t = t.float()
    try:
        return t.numpy()
    except (TypeError, RuntimeError) as exc:
        raise TypeError(f"an output tensor has dtype {_dtype_name(t.dtype)}, which has no numpy "
                        f"form ({exc})") from exc


def to_numpy(output: Any) -> Any:
    """Convert every tensor in an output to a numpy array (for requests sent as numpy)."""
    return map_tensors(output, _numpy)


def to_device(output: _Output, device: torch.device) -> _Output:
    """Move every tensor in an output to ``device`` (the device the request came from)."""
    moved: _Output = map_tensors(output, lambda t: t if t.device == device else t.to(device))
    return moved
