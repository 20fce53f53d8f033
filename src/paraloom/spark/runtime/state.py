"""Model and optimizer state as bytes (safetensors + a JSON header) and as flat vectors.

What crosses the driver/task boundary as *data* (parameters, optimizer state, checkpoints)
travels in these forms, never as pickles: ``pack``/``unpack`` for broadcasts, task results and
checkpoint files; ``flatten``/``unflatten`` for the parameter-averaging sums.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypedDict

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from paraloom.extra_state import join_extra_state, split_extra_state, tensors_of

__all__ = ["Packed", "pack", "unpack", "split_optimizer_state", "join_optimizer_state",
           "flatten", "unflatten", "state_digest", "OptimizerState", "OptimizerSkeleton",
           "Layout", "Meta"]

_META = "paraloom"
_MODEL = "model/"
_OPTIM = "optim/"

OptimizerState = dict[str, Any]
"""An optimizer's ``state_dict()``: ``{"state": {index: {key: tensor or number}},
"param_groups": [...]}``, whatever the user's optimizer keeps (torch types it so too)."""
Meta = dict[str, Any]
"""JSON-able metadata packed with a state (a checkpoint's position, its synchronizer state)."""


class OptimizerSkeleton(TypedDict):
    """An optimizer state without its tensors: JSON-able, sent alongside them."""

    scalars: dict[str, dict[str, object]]
    """Per parameter index, the values of its state that are not tensors (a step count)."""
    param_groups: list[dict[str, object]]
    """The param groups' settings (lr, momentum, ...) and parameter indices."""


@dataclass
class Packed:
    """What ``unpack`` returns: tensors by name, optimizer state (or None), and metadata."""

    model: dict[str, torch.Tensor]
    optimizer: OptimizerState | None = None
    meta: Meta = field(default_factory=dict)


def split_optimizer_state(state: OptimizerState
                          ) -> tuple[dict[str, torch.Tensor], OptimizerSkeleton]:
    """An optimizer ``state_dict()`` as (tensors by name, a JSON-able skeleton for the rest).

    Tensors come in one canonical order (parameter index, then key), whatever order the
    state's dicts happen to have: a state loaded from safetensors comes back in hash order,
    which differs between processes, and averaging needs every replica's layout alike.
    """
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, object]] = {}
    for index, values in sorted(state.get("state", {}).items(), key=lambda kv: int(kv[0])):
        for key, value in sorted(values.items()):
            if isinstance(value, torch.Tensor):
                tensors[f"{index}/{key}"] = value
            else:
                scalars.setdefault(str(index), {})[key] = value
    skeleton = OptimizerSkeleton(scalars=scalars, param_groups=state.get("param_groups", []))
    try:
        json.dumps(skeleton)
    except TypeError as e:
        raise TypeError(f"the optimizer state has a value that is neither a tensor nor a JSON "
                        f"number/string/list ({e}); use plain numbers for hyperparameters such "
                        f"as lr") from e
    return tensors, skeleton


def join_optimizer_state(tensors: dict[str, torch.Tensor],
                         skeleton: OptimizerSkeleton) -> OptimizerState:
    """The inverse of ``split_optimizer_state``: an optimizer ``state_dict()``."""
    state: dict[int, dict[str, object]] = {}
    for name, value in tensors.items():
        index, _, key = name.partition("/")
        state.setdefault(int(index), {})[key] = value
    for index, values in skeleton.get("scalars", {}).items():
        state.setdefault(int(index), {}).update(values)
    ordered = {i: dict(sorted(values.items())) for i, values in sorted(state.items())}
    return {"state": ordered, "param_groups": skeleton.get("param_groups", [])}


def _independent(t: torch.Tensor) -> torch.Tensor:
    # safetensors refuses shared or non-contiguous storage; keep independent CPU copies.
    return t.detach().to("cpu").contiguous().clone()


def pack(model: Mapping[str, Any], optimizer: OptimizerState | None = None,
         meta: Meta | None = None) -> bytes:
    """Model state (a ``state_dict``: tensors, and extra states that are tensors or JSON),
    optional optimizer state and JSON-able metadata as safetensors bytes."""
    own, extra = split_extra_state(model, "the model sent to Spark")
    tensors = {_MODEL + k: _independent(v) for k, v in own.items()}
    header: dict[str, object] = {"meta": meta or {}}
    if extra:
        header["extra_state"] = extra
    if optimizer is not None:
        opt_tensors, header["optimizer"] = split_optimizer_state(optimizer)
        tensors.update({_OPTIM + k: _independent(v) for k, v in opt_tensors.items()})
    return st_save(tensors, metadata={_META: json.dumps(header)})


def unpack(data: bytes) -> Packed:
    """Read bytes written by ``pack`` (safetensors: no code runs while loading)."""
    header_text = _metadata(data)
    if header_text is None:
        raise ValueError("these bytes have no paraloom header: they were not written by "
                         "paraloom.spark.runtime.state.pack")
    tensors = st_load(data)
    header = json.loads(header_text)
    model = join_extra_state({k[len(_MODEL):]: v for k, v in tensors.items()
                              if k.startswith(_MODEL)}, header.get("extra_state"))
    optimizer = None
    if "optimizer" in header:
        opt = {k[len(_OPTIM):]: v for k, v in tensors.items() if k.startswith(_OPTIM)}
        optimizer = join_optimizer_state(opt, header["optimizer"])
    return Packed(model=model, optimizer=optimizer, meta=header.get("meta", {}))


def _metadata(data: bytes) -> str | None:
    """The ``__metadata__`` entry of a safetensors header (8-byte length, then JSON)."""
    if len(data) < 8:
        raise ValueError(f"{len(data)} bytes is too short for a safetensors blob")
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    value = header.get("__metadata__", {}).get(_META)
    return value if isinstance(value, str) else None


Layout = list[tuple[str, list[int], str]]
"""(name, shape, dtype name) of each tensor in a flattened vector."""


def flatten(state: Mapping[str, Any]) -> tuple[np.ndarray, Layout]:
    """All tensors of ``state`` in one vector, and the layout to undo it (a module's extra
    state that is not a tensor is left out: it is not averaged).

    The vector is float32, or float64 when any tensor is float64 (or an integer type that
    float32 cannot hold exactly), so that no value loses precision on the way (but int64
    values past 2**53); a complex tensor travels as its real and imaginary parts.
    """
    tensors = tensors_of(state)
    layout = [(name, list(t.shape), str(t.dtype).removeprefix("torch."))
              for name, t in tensors.items()]
    wide = any(t.dtype in (torch.float64, torch.int64, torch.int32, torch.complex128)
               for t in tensors.values())
    dtype = torch.float64 if wide else torch.float32
    if not tensors:
        return np.zeros(0, dtype=np.float32), layout
    parts = [(torch.view_as_real(t.detach().cpu().resolve_conj()) if t.is_complex() else
              t.detach().cpu()).to(dtype).reshape(-1).numpy() for t in tensors.values()]
    return np.concatenate(parts), layout


def unflatten(vector: np.ndarray, layout: Layout) -> dict[str, torch.Tensor]:
    """Tensors from a ``flatten`` vector, cast back to their dtypes (integers rounded)."""
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for name, shape, dtype_name in layout:
        dtype = getattr(torch, dtype_name)
        n = (int(np.prod(shape)) if shape else 1) * (2 if dtype.is_complex else 1)
        chunk = torch.from_numpy(np.ascontiguousarray(vector[offset:offset + n]))
        if dtype.is_complex:  # its real and imaginary parts, as flatten laid them
            out[name] = torch.view_as_complex(chunk.to(dtype.to_real()).reshape(*shape, 2))
        else:
            chunk = chunk.reshape(shape)
            out[name] = (chunk if dtype.is_floating_point else chunk.round()).to(dtype)
        offset += n
    if offset != vector.size:
        raise ValueError(f"the vector has {vector.size} values but the layout describes "
                         f"{offset}; flatten and unflatten must see the same tensors")
    return out


def state_digest(state: Mapping[str, Any]) -> str:
    """SHA-256 of the tensors' names and raw bytes (and of the extra states' JSON): equal
    digests mean bit-identical states."""
    h = hashlib.sha256()
    for name in sorted(state):
        if not isinstance(state[name], torch.Tensor):
            h.update(f"{name}={json.dumps(state[name], sort_keys=True, default=repr)}".encode())
            continue
        t = state[name].detach().to("cpu").contiguous()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
