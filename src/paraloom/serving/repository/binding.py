"""How declared inputs and outputs meet a model's ``forward``, as Triton's PyTorch backend binds
a ``config.pbtxt``'s tensors to a TorchScript model.

Inputs, in the backend's order of precedence:

- **forward's argument names**: when every declared input is named after a parameter of
  ``forward``, each is passed by that name, whatever the declared order;
- **a dictionary input**: a TorchScript ``forward(self, inputs: Dict[str, Tensor])`` gets the
  inputs as one dict, keyed by their declared names;
- **``<name>__<index>``**: when every input name ends in ``__`` and a distinct number (the
  numbers 0..n-1), input ``x__i`` is ``forward``'s i-th argument;
- otherwise the declared order is ``forward``'s order.

Outputs: names that all end in ``__`` and distinct numbers pick those elements of what
``forward`` returns; otherwise the i-th declared output is the i-th element returned
(elements past the declared ones are not served).

A declared ``reshape`` (Triton's ``reshape: { shape: [...] }``) is the shape the model takes
or returns, the declared ``dims`` the shape on the wire; with a batch dimension, both leave
the rows out.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from paraloom.serving.signature import TensorSpec

__all__ = ["Binding", "BoundModel", "bind", "named_indices"]

_INDEXED = re.compile(r"^.+__(\d+)$")


def named_indices(names: Sequence[str], complete: bool = True) -> list[int] | None:
    """The ``<name>__<index>`` indices of ``names`` when every name has one and they differ
    (with ``complete``, they must be 0..n-1 in some order); None otherwise (the declared
    order applies)."""
    found = [_INDEXED.match(n) for n in names]
    if not names or not all(found):
        return None
    indices = [int(m.group(1)) for m in found if m is not None]
    if complete:
        return indices if sorted(indices) == list(range(len(names))) else None
    return indices if len(set(indices)) == len(indices) else None


@dataclass(frozen=True)
class _Parameters:
    """``forward``'s parameters (``self``, ``*args`` and ``**kwargs`` left out): names, which
    of them may be passed by position, and whether it takes one ``Dict[str, Tensor]``."""

    names: list[str]
    positional: set[str]
    takes_dict: bool = False


def _parameters(model: nn.Module) -> _Parameters:
    """``forward``'s parameters: from a TorchScript schema, else from Python's signature."""
    schema = getattr(getattr(model, "forward", None), "schema", None)
    if schema is not None:
        arguments = list(schema.arguments)[1:]
        names = [a.name for a in arguments]
        return _Parameters(names, {a.name for a in arguments if not a.kwarg_only},
                           len(arguments) == 1 and str(arguments[0].type).startswith("Dict[str,"))
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return _Parameters([], set())
    kind = inspect.Parameter
    named = [p for p in params if p.kind not in (kind.VAR_POSITIONAL, kind.VAR_KEYWORD)]
    return _Parameters([p.name for p in named], {
        p.name for p in named if p.kind in (kind.POSITIONAL_ONLY, kind.POSITIONAL_OR_KEYWORD)})


@dataclass(frozen=True)
class Binding:
    """How one model is called: ``keywords`` (pass inputs by these names), ``as_dict`` (pass
    one dict of them), ``positions`` (input i goes to argument ``positions[i]``), the model's
    shapes of reshaped inputs and the wire shapes of reshaped outputs (rows left out when
    ``batched``), and which returned element each declared output is (``picks``)."""

    names: tuple[str, ...]
    keywords: bool = False
    as_dict: bool = False
    positions: tuple[int, ...] | None = None
    input_shapes: tuple[tuple[int, ...] | None, ...] = ()
    output_shapes: tuple[tuple[int, ...] | None, ...] = ()
    picks: tuple[int, ...] | None = None
    batched: bool = True

    def call(self, model: nn.Module, inputs: Sequence[torch.Tensor]) -> Any:
        """Run ``model`` on the declared inputs (declared order); the declared outputs."""
        xs = [_reshape(x, s, self.batched) for x, s in zip(inputs, self.input_shapes,
                                                           strict=True)]
        if self.as_dict:
            result = model(dict(zip(self.names, xs, strict=True)))
        elif self.keywords:
            result = model(**dict(zip(self.names, xs, strict=True)))
        elif self.positions is not None:
            ordered: list[torch.Tensor] = [torch.empty(0)] * len(xs)
            for x, at in zip(xs, self.positions, strict=True):
                ordered[at] = x
            result = model(*ordered)
        else:
            result = model(*xs)
        return self._outputs(result)

    def _outputs(self, result: Any) -> Any:
        if isinstance(result, Mapping) or (self.picks is None and not self.output_shapes):
            return result
        returned = [result] if isinstance(result, torch.Tensor) else list(result)
        picked = returned if self.picks is None else [returned[i] for i in self.picks]
        shapes = self.output_shapes or (None,) * len(picked)
        out = [_reshape(t, s, self.batched) for t, s in zip(picked, shapes, strict=False)]
        return out[0] if len(out) == 1 else tuple(out)


def _reshape(x: torch.Tensor, shape: tuple[int, ...] | None, batched: bool) -> torch.Tensor:
    if shape is None:
        return x
    return x.reshape(x.shape[0], *shape) if batched else x.reshape(shape)


class BoundModel(nn.Module):
    """A model called through its ``Binding`` (declared inputs in, declared outputs out)."""

    def __init__(self, model: nn.Module, binding: Binding) -> None:
        super().__init__()
        self.model = model
        self.binding = binding

    def forward(self, *inputs: torch.Tensor) -> Any:
        """The wrapped model's declared outputs for the declared inputs."""
        return self.binding.call(self.model, inputs)


def bind(model: nn.Module, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec], *,
         reshape: Mapping[str, tuple[int, ...]] | None = None, batched: bool = True
         ) -> nn.Module:
    """``model`` wrapped to take its declared ``inputs`` and give its declared ``outputs`` as
    Triton's PyTorch backend would (see the module's doc); ``model`` itself where nothing
    differs from calling it with the inputs in order and taking what it returns. ``reshape``:
    the model's shape of a declared tensor, by name (rows left out when ``batched``);
    ``ValueError`` for a name that is not declared."""
    reshape = reshape or {}
    names = tuple(s.name for s in inputs)
    out_names = [s.name for s in outputs]
    unknown = sorted(set(reshape) - {*names, *out_names})
    if unknown:
        raise ValueError(f"reshape names {unknown}, which are not declared inputs or outputs "
                         f"({[*names, *out_names]})")
    wire = [s.shape[1:] if batched else s.shape for s in outputs]
    binding = Binding(
        names, input_shapes=tuple(reshape.get(n) for n in names),
        output_shapes=tuple(w if s.name in reshape else None for s, w in zip(
            outputs, wire, strict=True)) if any(n in reshape for n in out_names) else (),
        picks=_picks(out_names), batched=batched)
    binding = _by_name(binding, names, _parameters(model))
    if binding == Binding(names, input_shapes=(None,) * len(names), batched=batched):
        return model
    return BoundModel(model, binding)


def _by_name(binding: Binding, names: tuple[str, ...], params: _Parameters) -> Binding:
    """``binding`` with the inputs placed as the backend places them (the module's doc)."""
    leading = params.names[:len(names)]
    if names and set(names) <= set(params.names):  # forward's own names
        if set(names) == set(leading) and set(names) <= params.positional:
            order = tuple(leading.index(n) for n in names)  # by position: any kind of them
            return binding if order == tuple(range(len(names))) else replace(
                binding, positions=order)
        return replace(binding, keywords=True)  # keyword-only ones, or a subset with defaults
    if params.takes_dict:
        return replace(binding, as_dict=True)
    positions = named_indices(names)
    if positions is not None and positions != list(range(len(names))):
        return replace(binding, positions=tuple(positions))
    return binding


def _picks(outputs: Sequence[str]) -> tuple[int, ...] | None:
    indices = named_indices(outputs, complete=False)  # a model may return more than served
    return None if indices is None or indices == list(range(len(outputs))) else tuple(indices)
