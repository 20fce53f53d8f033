"""Decoding messages into tensors: one exact addition per element moved."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from paraloom.sync.encoding.formats import (
    ELEMENTS_PER_WORD,
    GAP_ESCAPE,
    GAP_MAX,
    Encoded,
    Format,
    Steps,
)

__all__ = ["add_at_", "add_at_flat_", "decode", "decode_into", "fill_at_flat_", "moved_index",
           "per_tensor"]


def _steps(format: Format, payload: Tensor) -> tuple[Tensor, Tensor]:
    """The flat indices (int64, ascending) a sparse message moves, and whether each step is +."""
    if format == Format.GAP16:
        return _gap16_steps(payload)
    return payload.abs().to(torch.int64) - 1, payload > 0


def _gap16_steps(payload: Tensor) -> tuple[Tensor, Tensor]:
    """The ascending flat indices (int64) a gap16 payload moves, and whether each step is +."""
    entries = payload.contiguous().view(torch.int16).to(torch.int64)
    escape = entries == GAP_ESCAPE
    index = torch.where(escape, GAP_MAX, entries.abs()).cumsum(0) - 1
    keep = ~escape & (entries != 0)
    return index[keep], entries[keep] > 0


def _bitmap_codes(msg: Encoded) -> Tensor:
    words = msg.payload.to(torch.int64) & 0xFFFFFFFF
    shifts = 2 * torch.arange(ELEMENTS_PER_WORD, dtype=torch.int64, device=words.device)
    return ((words.unsqueeze(1) >> shifts) & 3).reshape(-1)[: msg.numel]


def _sparse_steps(msg: Encoded, steps: Steps | None, device: torch.device) -> Steps:
    if steps is not None:
        if msg.format == Format.BITMAP:
            raise ValueError("steps= given for a bitmap message; expected them only for a "
                             "threshold or gap16 message (the bitmap has half steps too)")
        return steps[0].to(device), steps[1].to(device)
    return _steps(msg.format, msg.payload.to(device))


def moved_index(msg: Encoded, *, steps: Steps | None = None) -> Tensor:
    """The flat indices (int64, ascending) of the elements the message moves, half steps too.

    ``steps`` (sparse messages only, e.g. ``message_steps(found)``) saves parsing the payload.
    """
    if msg.payload.numel() == 0:
        return torch.empty(0, dtype=torch.int64, device=msg.payload.device)
    if msg.format == Format.BITMAP:
        return torch.nonzero(_bitmap_codes(msg)).reshape(-1)
    return _sparse_steps(msg, steps, msg.payload.device)[0]


def _bitmap_values(msg: Encoded, dtype: torch.dtype) -> Tensor:
    codes = _bitmap_codes(msg)
    tau = msg.tau
    table = torch.tensor([0.0, tau, -tau, msg.half_sign * tau / 2], dtype=dtype,
                         device=codes.device)
    return table[codes]


def decode(msg: Encoded, out: Tensor, *, sign: int = 1, steps: Steps | None = None) -> Tensor:
    """Add the decoded message into ``out`` in place (``sign=-1`` subtracts it); returns ``out``.

    ``out`` is a contiguous float tensor of ``msg.numel`` elements, of any float dtype;
    the steps are powers of two, so they are exact in ``out``'s dtype when in its range.
    ``steps`` (sparse messages only) saves parsing the payload.
    """
    if sign not in (1, -1):
        raise ValueError(f"sign={sign!r}; expected 1 (add) or -1 (subtract)")
    if not out.is_floating_point() or not out.is_contiguous() or out.numel() != msg.numel:
        raise ValueError(f"out must be a contiguous float tensor of {msg.numel} elements; got "
                         f"{out.dtype} of {out.numel()} elements, contiguous={out.is_contiguous()}")
    flat = out.view(-1)
    if msg.payload.numel() == 0:
        return out
    if msg.format == Format.BITMAP:
        values = _bitmap_values(msg, out.dtype).to(flat.device)
        flat.add_(values) if sign == 1 else flat.sub_(values)
        return out
    if msg.format not in (Format.THRESHOLD, Format.GAP16):
        raise ValueError(f"format={msg.format!r}; expected Format.THRESHOLD, Format.GAP16 or "
                         "Format.BITMAP")
    index, positive = _sparse_steps(msg, steps, flat.device)
    step = torch.tensor(msg.tau * sign, dtype=out.dtype, device=flat.device)
    values = torch.where(positive, step, -step)
    flat.scatter_add_(0, index, values)  # indices are unique: one exact addition each
    return out


def decode_into(msg: Encoded, outs: Sequence[Tensor], bounds: Tensor, *,
                mirror: Tensor | None = None, steps: Steps | None = None,
                factor: float = 1.0) -> None:
    """Add the decoded message, times ``factor``, into tensors laid end to end (e.g. a model's
    parameters), and into ``mirror``, one flat tensor as long as all of them, when given.

    ``bounds`` holds their cumulative element counts; the tensors are read in row-major order
    whatever their memory layout. A threshold message touches only its own elements (no
    temporary of the model's size), and is decoded once for the tensors and the mirror: each
    element gets the same single addition in both. ``steps`` (sparse messages only) saves
    parsing the payload.
    """
    if msg.payload.numel() == 0:
        return
    if msg.format == Format.BITMAP:
        values = _bitmap_values(msg, outs[0].dtype)
        if factor != 1.0:
            values = values * factor
        begin = 0
        for out in outs:
            out.add_(values[begin: begin + out.numel()].view(out.shape).to(out.device, out.dtype))
            begin += out.numel()
        if mirror is not None:
            mirror.add_(values.to(mirror.device, mirror.dtype))
        return
    index, positive = _sparse_steps(msg, steps, outs[0].device)
    step = torch.tensor(msg.tau * factor, dtype=outs[0].dtype, device=outs[0].device)
    values = torch.where(positive, step, -step)
    add_at_(outs, bounds, index, values)  # tau is exact in every float dtype
    if mirror is not None:
        mirror.scatter_add_(0, index.to(mirror.device), values.to(mirror.device, mirror.dtype))


def per_tensor(index: Tensor, tensors: Sequence[Tensor], bounds: Tensor,
               ) -> Iterator[tuple[Tensor, slice, Tensor]]:
    """Split ascending flat ``index``es of tensors laid end to end (``bounds``: their cumulative
    element counts): ``(tensor, slice of index, indices within the tensor)`` for each tensor
    that has some."""
    if index.numel() == 0:
        return
    cuts = torch.searchsorted(index, bounds.to(index.device)).tolist()
    start = begin = 0
    for t, end in zip(tensors, cuts, strict=True):
        if end > start:
            yield t, slice(start, end), index[start:end].to(t.device) - begin
        start, begin = end, begin + t.numel()


def add_at_(outs: Sequence[Tensor], bounds: Tensor, index: Tensor, values: Tensor) -> None:
    """Add ``values`` at the ascending flat ``index``es of tensors laid end to end
    (``bounds``: their cumulative element counts), each in its tensor's dtype."""
    if len(outs) == 1:  # one tensor: no split (and no host synchronization to find one)
        add_at_flat_(outs[0], index.to(outs[0].device), values.to(outs[0].dtype))
        return
    for out, part, flat in per_tensor(index, outs, bounds):
        add_at_flat_(out, flat, values[part].to(out.dtype))


def add_at_flat_(t: Tensor, flat: Tensor, values: Tensor) -> None:
    """Add ``values`` to ``t``'s elements at the unique row-major flat indices ``flat``,
    whatever ``t``'s memory layout (channels_last too): one exact addition each."""
    if t.is_contiguous():
        t.view(-1).scatter_add_(0, flat, values)  # several times faster than index_put_
    else:
        t.index_put_(torch.unravel_index(flat, t.shape), values, accumulate=True)


def fill_at_flat_(t: Tensor, flat: Tensor, value: float) -> None:
    """Set ``t``'s elements at the row-major flat indices ``flat`` to ``value``, whatever
    ``t``'s memory layout."""
    if t.is_contiguous():
        t.view(-1).index_fill_(0, flat, value)
    else:
        t[torch.unravel_index(flat, t.shape)] = value
