"""Precision of a replica's forward pass, by Lightning's names.

``"32-true"`` (default) runs the model as given. ``"16-mixed"`` / ``"bf16-mixed"`` keep the
weights and run the forward under ``torch.autocast``. ``"16-true"`` / ``"bf16-true"`` convert the
replica's weights (never the user's model) and the floating-point inputs to half precision. All
but ``"32-true"`` return floating-point outputs as float32, as Lightning does, so callers see the
same dtypes whatever the precision.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TypeVar

import torch
from torch import nn

from paraloom.data import map_tensors
from paraloom.extra_state import tensors_of

__all__ = ["Precision", "PRECISIONS", "resolve_precision"]

# A model's output structure: converting its tensors gives the same structure back.
_Output = TypeVar("_Output")


class Precision:
    """How a replica computes: the dtype of its weights and an optional autocast dtype."""

    __slots__ = ("name", "param_dtype", "autocast_dtype")

    def __init__(self, name: str, *, param_dtype: torch.dtype | None = None,
                 autocast_dtype: torch.dtype | None = None) -> None:
        self.name = name
        self.param_dtype = param_dtype
        self.autocast_dtype = autocast_dtype

    def __repr__(self) -> str:
        return f"Precision({self.name!r})"

    def check_device(self, device: torch.device) -> None:
        """Raise ValueError if ``device`` cannot run this precision."""
        half = self.param_dtype or self.autocast_dtype
        if half is None:
            return
        if half is torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ValueError(
                f"precision={self.name!r} needs bfloat16, which {device} "
                f"({torch.cuda.get_device_name(device)}) does not support; use '16-mixed' or "
                "'32-true'")
        if self.autocast_dtype is not None and not torch.amp.is_autocast_available(device.type):
            raise ValueError(f"precision={self.name!r} needs torch.autocast, which is not "
                             f"available on device type {device.type!r}; use '32-true'")

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Convert a replica's floating-point weights and buffers (in place) if this is -true."""
        return module.to(self.param_dtype) if self.param_dtype is not None else module

    def cast(self, tensor: torch.Tensor) -> torch.Tensor:
        """A floating-point input cast to the weights' dtype if this is -true."""
        if self.param_dtype is None or not tensor.is_floating_point():
            return tensor
        return tensor.to(self.param_dtype)

    def convert_inputs(self, tensors: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        """Cast floating-point inputs to the weights' dtype if this is -true."""
        dtype = self.param_dtype
        if dtype is None:
            return tensors
        return [t.to(dtype) if t.is_floating_point() else t for t in tensors]

    def forward_context(self, device: torch.device) -> contextlib.AbstractContextManager[None]:
        """The context the forward pass runs in: autocast for -mixed, nothing otherwise."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.autocast_dtype)

    def keep_untrained(self, model: nn.Module, state: dict[str, torch.Tensor]
                       ) -> dict[str, torch.Tensor]:
        """``state`` (a -true replica's, in half precision) for the user's ``model``, with each
        tensor that is the model's own converted (training never changed it: a frozen layer)
        replaced by the model's own, so that its full precision is not lost on the way back;
        a non-persistent buffer too."""
        if self.param_dtype is None:
            return state
        # The buffers outside state_dict() (persistent=False: a rotary cache) travel too.
        own = {**dict(model.named_buffers()), **tensors_of(model.state_dict())}
        kept = dict(state)
        for key, value in tensors_of(state).items():
            mine = own.get(key)
            if mine is not None and mine.is_floating_point() and value.dtype == self.param_dtype \
                    and mine.shape == value.shape and torch.equal(  # a CUDA model: the CPU's
                        mine.detach().to(value.device, value.dtype), value):
                kept[key] = mine
        return kept

    def convert_output(self, output: _Output) -> _Output:
        """Give floating-point outputs back as float32 unless this is 32-true."""
        if self.param_dtype is None and self.autocast_dtype is None:
            return output
        converted: _Output = map_tensors(output, _to_float32)
        return converted


def _to_float32(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.is_floating_point() and t.dtype != torch.float32 else t


PRECISIONS: dict[str, Precision] = {
    "32-true": Precision("32-true"),
    "16-mixed": Precision("16-mixed", autocast_dtype=torch.float16),
    "bf16-mixed": Precision("bf16-mixed", autocast_dtype=torch.bfloat16),
    "16-true": Precision("16-true", param_dtype=torch.float16),
    "bf16-true": Precision("bf16-true", param_dtype=torch.bfloat16),
}


def resolve_precision(precision: str | Precision) -> Precision:
    """Look a precision up by name; the error lists the valid names."""
    if isinstance(precision, Precision):
        return precision
    if not isinstance(precision, str):
        raise TypeError(f"precision must be a string such as '32-true'; got "
                        f"{type(precision).__name__} {precision!r}")
    try:
        return PRECISIONS[precision]
    except KeyError:
        raise ValueError(f"precision={precision!r} is not known; expected one of "
                         f"{', '.join(map(repr, PRECISIONS))}") from None
