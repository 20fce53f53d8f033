"""The local view: the shared parameters plus this replica's own unsent updates.

With ``gradients_at="local"`` the parameters hold the local view from a fit's first step to
its end: ``p = old + reach * residual``, where ``old`` holds the shared parameters and
``reach`` undoes the residual's ``1 / world_size`` scale (``combine="mean"``). Pure functions
on tensors, chunk by chunk so that the few elementwise operations on each chunk keep it in
the CPU's cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from paraloom.sync.encoding import scan_chunk

__all__ = ["accumulate_update_", "add_range_", "chunks", "local_views", "parameter_names",
           "residual_from_view_", "set_local_view_", "summed_residuals"]


def chunks(params: Sequence[Tensor], old: Sequence[Tensor], residual: Sequence[Tensor],
           chunk: int | None = None) -> list[tuple[Tensor, Tensor, Tensor]]:
    """The three tensors of each parameter, cut into matching chunks (default ``scan_chunk``
    elements) so that a sequence of elementwise operations keeps each chunk in cache."""
    parts = []
    for p, o, r in zip(params, old, residual, strict=True):
        size = chunk or scan_chunk(p.device)
        if p.is_contiguous() and o.is_contiguous():
            parts += [(p.view(-1)[i: i + size], o.view(-1)[i: i + size],
                       r.view(-1)[i: i + size]) for i in range(0, p.numel(), size)]
        else:  # e.g. channels_last: elementwise on the whole tensor, any layout
            parts.append((p, o, r))
    return parts


def add_range_(tensors: Sequence[Tensor], begin: int, values: Tensor, alpha: float) -> None:
    """Add ``alpha * values`` to the elements ``begin`` to ``begin + len(values)`` of
    contiguous tensors laid end to end (a zero adds nothing: ``x + 0.0 == x``)."""
    end, offset = begin + values.numel(), 0
    for t in tensors:
        lo, hi = max(begin, offset), min(end, offset + t.numel())
        if lo < hi:
            t.view(-1)[lo - offset: hi - offset].add_(
                values[lo - begin: hi - begin].to(t.dtype), alpha=alpha)
        offset += t.numel()
        if offset >= end:
            return


def set_local_view_(params: Sequence[Tensor], old: Sequence[Tensor], residual: Sequence[Tensor],
                    reach: float, chunk: int | None = None) -> None:
    """``p = old + reach * residual`` for each parameter: the shared parameters plus this
    replica's own unsent updates."""
    for p_part, o_part, r_part in chunks(params, old, residual, chunk):
        torch.add(o_part, r_part, alpha=reach, out=p_part)


def residual_from_view_(params: Sequence[Tensor], old: Sequence[Tensor],
                        residual: Sequence[Tensor], scale: float, chunk: int | None = None) -> None:
    """``residual = scale * (p - old)``: what the local view, moved by the optimizer's step,
    holds beyond the shared parameters (one pass that writes only the residual)."""
    for p_part, o_part, r_part in chunks(params, old, residual, chunk):
        torch.sub(p_part, o_part, out=r_part)
        if scale != 1.0:
            r_part.mul_(scale)


def accumulate_update_(params: Sequence[Tensor], old: Sequence[Tensor], residual: Sequence[Tensor],
                       scale: float, chunk: int | None = None) -> None:
    """``residual += scale * (p - old)``, then ``p = old``, for each parameter (gradients at
    the shared parameters), chunk by chunk so that the three tensors' chunks stay in cache
    across the three operations."""
    for p_part, o_part, r_part in chunks(params, old, residual, chunk):
        p_part.sub_(o_part)  # the update, in place: no temporary
        r_part.add_(p_part, alpha=scale)
        p_part.copy_(o_part)  # from here on only the decoded messages move the parameters


def summed_residuals(residual: Tensor, group: Any, world_size: int) -> Tensor:
    """Every replica's ``residual`` (flat, each already scaled as messages are) summed, with
    one dense all-reduce: the updates the messages left unsent, as every replica would apply
    them."""
    import torch.distributed as dist

    total = residual.detach().clone()
    if world_size > 1:
        dist.all_reduce(total, group=group)
    return total


def parameter_names(model: nn.Module, params: Sequence[Tensor]) -> list[list[str]]:
    """Each of ``params``' keys in ``model.state_dict()`` (several for a shared one; as it
    names them, hooks and overrides included), so that a saved local view can be read without
    the model."""
    names: dict[int, list[str]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        names.setdefault(id(t), []).append(name)
    return [names.get(id(p), []) for p in params]


def local_views(states: Sequence[dict[str, Any]]) -> dict[str, list[Tensor]]:
    """From every replica's ``SharedGradients.state_dict()``: each replica's local view of
    each parameter, by ``state_dict`` key (their mean is what ``fit()`` would return at that
    point). Empty unless every replica's state holds its view and the view's names (with
    gradients at the shared parameters no replica holds one)."""
    views: list[list[Tensor]] = [s.get("local_view") or [] for s in states]
    names: list[list[str]] = states[0].get("local_view_names") or [] if states else []
    if not names or not all(views):
        return {}
    return {name: [view[i] for view in views] for i, keys in enumerate(names) for name in keys}
