"""What modules' ``get_extra_state()`` put in a ``state_dict``, in files that hold tensors.

``state_dict()`` holds, beside parameters and buffers, each module's ``get_extra_state()``
under ``<module>._extra_state``: any object. A safetensors file holds tensors and a JSON
header, and paraloom never unpickles what it reads, so an extra state is kept as it is where it
is a tensor and in the header where it is JSON (numbers, strings, lists, dicts with string
keys; read back as JSON reads it: a tuple as a list); anything else is refused, naming the
module, before a file is written.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["EXTRA_STATE", "detached_state", "is_extra_state", "join_extra_state",
           "split_extra_state", "tensors_of"]

EXTRA_STATE = "_extra_state"
"""The last part of an extra state's name in a ``state_dict`` (``torch.nn.Module``'s)."""


def is_extra_state(name: str) -> bool:
    """Whether ``name`` in a ``state_dict`` is a module's ``get_extra_state()``."""
    return name == EXTRA_STATE or name.endswith("." + EXTRA_STATE)


def tensors_of(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The tensors of a ``state_dict`` (extra states that are not tensors left out)."""
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def split_extra_state(state: Mapping[str, Any], what: str
                      ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``state`` (a ``state_dict``) as its tensors and its extra states that are not tensors
    (JSON values, for a file's header). ``TypeError``, naming ``what`` (the caller) and the
    module, for an extra state that is neither, or a value that is not a tensor elsewhere."""
    extra: dict[str, Any] = {}
    for name, value in state.items():
        if isinstance(value, torch.Tensor):
            continue
        prefix = name.removesuffix(EXTRA_STATE).removesuffix(".")
        owner = f"module {prefix!r}" if prefix else "the model"
        if not is_extra_state(name):
            raise TypeError(f"{what}: {name!r} in the state_dict is a {type(value).__name__}, "
                            "not a tensor; only a module's get_extra_state() may be another "
                            "value")
        try:
            json.dumps(value, allow_nan=True)
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"{what}: the extra state of {owner} (its get_extra_state()) is a "
                f"{type(value).__name__} that is neither a tensor nor JSON ({e}); a safetensors "
                "file holds tensors and JSON values, and paraloom unpickles nothing: return a "
                "tensor, or numbers, strings, lists and dicts, from get_extra_state") from e
        extra[name] = value
    return tensors_of(state), extra


def join_extra_state(tensors: Mapping[str, torch.Tensor], extra: object
                     ) -> dict[str, Any]:
    """The inverse of ``split_extra_state``: ``tensors`` with the extra states read from a
    header (``extra``: its JSON object, or None where the file has none)."""
    if extra is None:
        return dict(tensors)
    if not isinstance(extra, dict) or not all(isinstance(k, str) and is_extra_state(k)
                                              for k in extra):
        raise ValueError("the file's extra states are not an object of <module>._extra_state "
                         "names: it is corrupt; write it again")
    return {**tensors, **extra}


def detached_state(state: Mapping[str, Any], swaps: Mapping[int, torch.Tensor]
                   ) -> dict[str, Any]:
    """``state`` (a ``state_dict(keep_vars=True)``) with its tensors detached, each one in
    ``swaps`` (by ``id``) replaced by the tensor there; extra states as they are."""
    return {name: swaps.get(id(t), t).detach() if isinstance(t, torch.Tensor) else t
            for name, t in state.items()}
