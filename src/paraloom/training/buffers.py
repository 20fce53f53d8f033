"""Buffers registered with ``persistent=False``: outside ``state_dict()``, yet part of what a
replica computes with (a mask, a rotary cache, a temperature the user sets between fits).

A replica's model state travels as ``state_dict()`` plus these (``with_transient``): a value the
user set goes out with the next fit(), and what training left in them comes back, as it would
in a training loop of the user's own. Checkpoints keep ``state_dict()`` as it is, with the
transient buffers beside it, so a checkpoint's weights load with ``load_state_dict``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

__all__ = ["load_model_state", "load_transient", "transient_buffers", "with_transient"]


def transient_buffers(model: nn.Module, state: Mapping[str, torch.Tensor] | None = None
                      ) -> dict[str, torch.Tensor]:
    """The model's buffers that ``state_dict()`` leaves out, by their dotted names (``state``:
    the model's ``state_dict()`` when the caller has it already)."""
    persistent = (model.state_dict(keep_vars=True) if state is None else state).keys()
    return {name: buffer for name, buffer in model.named_buffers() if name not in persistent}


def with_transient(model: nn.Module, state: Mapping[str, torch.Tensor]
                   ) -> dict[str, torch.Tensor]:
    """``state`` (the model's ``state_dict()``) with the transient buffers added (detached)."""
    return {**state, **{k: v.detach() for k, v in transient_buffers(model, state).items()}}


def load_model_state(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """``model.load_state_dict`` (strict) for what ``state_dict()`` holds; the transient
    buffers ``state`` has are loaded too (those it lacks keep their values). A buffer whose
    shape training changed (a history it extends, an observer's statistics) takes the new
    shape, as it would in a loop of the user's own; a parameter's shape must match."""
    transient = transient_buffers(model)
    buffers = dict(model.named_buffers())
    resized = {k: v.to(buffers[k].dtype) for k, v in state.items()  # dtypes as they are
               if k in buffers and k not in transient and v.shape != buffers[k].shape}
    _copy_into(model, buffers, resized)
    model.load_state_dict({k: v for k, v in state.items() if k not in transient})
    _copy_into(model, transient, {k: v for k, v in state.items() if k in transient})


def load_transient(model: nn.Module, buffers: Mapping[str, torch.Tensor]) -> None:
    """Copy ``buffers`` into the model's transient buffers of those names (in place where the
    shape and dtype agree, else replacing the buffer on its device); other names are skipped."""
    _copy_into(model, transient_buffers(model), buffers)


def _copy_into(model: nn.Module, own: Mapping[str, torch.Tensor],
               buffers: Mapping[str, torch.Tensor]) -> None:
    """``load_transient`` with the model's transient buffers (``own``) at hand."""
    with torch.no_grad():
        for name, value in buffers.items():
            target = own.get(name)
            if target is None:
                continue
            if target.shape == value.shape and (target.dtype == value.dtype or (
                    target.is_floating_point() and value.is_floating_point())):
                target.copy_(value)  # into the replica's dtype (bf16-true converted it)
            else:
                owner, _, attr = name.rpartition(".")
                setattr(model.get_submodule(owner), attr, value.to(target.device).clone())
