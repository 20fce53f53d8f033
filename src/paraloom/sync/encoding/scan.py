"""One pass over a residual: the elements a full step moves, and each chunk's peak."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from paraloom.sync.encoding.formats import Steps, precision_bits, quantize_threshold

__all__ = ["EXACT_TOP_NUMEL", "SCAN_CHUNK", "Scan", "check_flat", "full_step_mask",
           "keep_largest", "message_steps", "scan", "scan_chunk", "top_count"]

SCAN_CHUNK = 1 << 19
"""Elements per chunk of ``scan``: 2 MiB of float32, which stays in a CPU's cache (with the
scratch, and with two more such chunks in the sharing step's update pass) between operations:
on a 37.8M-element residual 2^18 to 2^20 ran within 10% of each other, 2^16 25% slower."""

EXACT_TOP_NUMEL = 1 << 16
"""Up to this many elements, ``top_count`` takes the exact top-k of a residual in one pass: a
sampled quantile would read every element anyway, and the scan and the top-k of what it found
cost about 20 small operations more."""


def full_step_mask(v: Tensor, mantissa: int, exponent: int,
                   scratch: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Elements a full step moves exactly: ``tau <= |v| < 2**(exponent + p)``, never NaN/inf.

    Comparisons on ``v`` itself, not on ``|v|``: no float temporary the size of ``v``. Two
    bool tensors shaped like ``v`` given as ``scratch`` are reused instead of allocated (the
    mask returned is the first).
    """
    # Python floats compare in v's dtype; a bound above the dtype's range becomes inf (no bound).
    tau = math.ldexp(mantissa, exponent)
    upper = math.ldexp(1.0, exponent + precision_bits(v.dtype))
    if scratch is None:
        scratch = (torch.empty(v.shape, dtype=torch.bool, device=v.device),
                   torch.empty(v.shape, dtype=torch.bool, device=v.device))
    full, other = scratch
    torch.ge(v, tau, out=full)
    full |= torch.le(v, -tau, out=other)
    # The bound rarely matters: skip its (costly) comparisons when every element is within it.
    if v.numel():
        low, high = torch.aminmax(v)
        if not (float(high) < upper and float(low) > -upper):  # also true for NaN
            full &= torch.lt(v, upper, out=other)
            full &= torch.gt(v, -upper, out=other)
    return full


class Scan(NamedTuple):
    """What one pass over a residual found for a threshold ``tau = mantissa * 2**exponent``."""

    mantissa: int
    exponent: int
    indices: Tensor
    """Ascending flat indices (int64) of the elements a full step moves (``full_step_mask``)."""
    values: Tensor
    """Per index, its element's value (in ``v``'s dtype)."""
    peaks: Tensor
    """Each chunk's largest ``|v|`` (in ``v``'s dtype; NaN where the chunk holds a NaN)."""
    chunk: int
    """Elements per chunk: chunk ``i`` is ``v.reshape(-1)[i * chunk:(i + 1) * chunk]``."""

    @property
    def tau(self) -> float:
        return math.ldexp(self.mantissa, self.exponent)

    @property
    def positive(self) -> Tensor:
        """Per index, whether its step is ``+tau``."""
        return self.values > 0


def scan_chunk(device: torch.device) -> int:
    """``SCAN_CHUNK`` on a CPU; 16M elements on an accelerator, which has no cache to keep a
    chunk in and pays a host synchronization per chunk (``nonzero``)."""
    return SCAN_CHUNK if device.type == "cpu" else 1 << 24


def scan(v: Tensor, tau: float, *, chunk: int | None = None) -> Scan:
    """The full steps of ``v`` for ``tau`` (rounded as ``quantize_threshold`` does) and each
    chunk's peak magnitude, in one pass: the same indices as ``full_step_mask``, chunk by chunk
    (a scratch of ``chunk`` elements, never one the size of ``v``; default ``scan_chunk``)."""
    flat = check_flat(v)
    if chunk is None:
        chunk = scan_chunk(flat.device)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk={chunk!r}; expected an int >= 1 (elements per pass)")
    mantissa, exponent = quantize_threshold(tau, flat.dtype)
    step = math.ldexp(mantissa, exponent)
    numel = flat.numel()
    peaks = flat.new_empty(-(-numel // chunk))
    magnitude = flat.new_empty(min(chunk, numel))
    full = torch.empty(min(chunk, numel), dtype=torch.bool, device=flat.device)
    found = []
    for i, begin in enumerate(range(0, numel, chunk)):
        part = flat[begin: begin + chunk]
        size = part.numel()
        torch.abs(part, out=magnitude[:size])
        index = _reaching(magnitude[:size], step, full[:size], peaks[i])
        if index.numel():
            found.append(index.add_(begin))
    index = torch.cat(found) if found else torch.empty(0, dtype=torch.int64, device=flat.device)
    values = flat.index_select(0, index)
    upper = math.ldexp(1.0, exponent + precision_bits(flat.dtype))
    if index.numel() and not bool(peaks.max() < upper):  # inf, NaN, or past the exact bound
        exact = values.abs() < upper
        index, values = index[exact], values[exact]
    return Scan(mantissa, exponent, index, values, peaks, chunk)


_ROW = 32
"""Elements per row of ``_reaching``'s first level: each row's peak is one vectorised reduction,
and only rows whose peak reaches the step are compared element by element."""


def _reaching(magnitude: Tensor, step: float, full: Tensor, peak: Tensor) -> Tensor:
    """Ascending indices of ``magnitude``'s elements that reach ``step`` (NaN never does), its
    largest element written into ``peak`` (NaN where it holds one); ``full`` is scratch.

    On a CPU the comparison to a bool mask and ``nonzero`` cost ten times the reduction per
    element, so a sparse message's scan compares rows of ``_ROW`` first: for 335k elements at
    0.4% density 0.3-0.45 ms against 0.75-0.95 ms for the mask of every element. Where more
    than a quarter of the rows reach the step (a dense message), or on an accelerator (each
    ``nonzero`` is a host synchronization), every element is compared at once.
    """
    whole = magnitude.numel() - magnitude.numel() % _ROW
    if magnitude.device.type != "cpu" or whole == 0:
        return _reaching_each(magnitude, step, full, peak)
    grid = magnitude[:whole].view(-1, _ROW)
    rows = grid.amax(1)
    torch.amax(rows, dim=0, out=peak)
    tail = magnitude[whole:]
    if tail.numel():
        torch.maximum(peak, tail.amax(), out=peak)
    hit = torch.nonzero(~(rows < step)).reshape(-1)  # a NaN row may hold elements that reach
    if 4 * hit.numel() > rows.numel():
        return _masked(magnitude, step, full)
    inner = torch.nonzero(grid.index_select(0, hit) >= step)
    index = hit.index_select(0, inner[:, 0]).mul_(_ROW).add_(inner[:, 1])
    if tail.numel():
        index = torch.cat([index, torch.nonzero(tail >= step).reshape(-1).add_(whole)])
    return index


def _reaching_each(magnitude: Tensor, step: float, full: Tensor, peak: Tensor) -> Tensor:
    """``_reaching`` by one mask over every element."""
    torch.amax(magnitude, dim=0, out=peak)
    return _masked(magnitude, step, full)


def _masked(magnitude: Tensor, step: float, full: Tensor) -> Tensor:
    """Ascending indices of the elements that reach ``step``, from a mask of them in ``full``."""
    torch.ge(magnitude, step, out=full)
    return torch.nonzero(full).reshape(-1)


def keep_largest(found: Scan, count: int) -> Scan:
    """The ``count`` elements of ``found`` with the largest magnitudes (all of them when it
    holds no more), each moved by the largest tau that they all reach.

    Deep Gradient Compression's hierarchical top-k: a sampled threshold selects a few more
    elements than wanted, and an exact top-k of the selected keeps ``count``. tau is the
    smallest kept magnitude rounded down to ``quantize_threshold``'s grid, so every step stays
    exact; an element past the exact bound of the new tau (see the module docstring) is left
    out, as ``scan`` leaves it out.
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"count={count!r}; expected an int >= 0 (elements to keep)")
    index, values = found.indices, found.values
    if index.numel() > count:
        index, values = _largest(index, values, count)
    if index.numel() == 0:
        return found._replace(indices=index, values=values)
    dtype = values.dtype
    smallest = float(values.abs().min())
    mantissa, exponent = quantize_threshold(smallest, dtype, round_down=True)
    if math.ldexp(mantissa, exponent) < found.tau:  # float rounding: never below the scan's
        mantissa, exponent = found.mantissa, found.exponent
    upper = math.ldexp(1.0, exponent + precision_bits(dtype))
    if not bool(values.abs().max() < upper):
        exact = values.abs() < upper
        index, values = index[exact], values[exact]
    return Scan(mantissa, exponent, index, values, found.peaks, found.chunk)


def _largest(index: Tensor, values: Tensor, count: int) -> tuple[Tensor, Tensor]:
    """The ``count`` entries of largest magnitude, in their order: a top-k of whichever is
    fewer, the kept or the dropped (for 236k of 300k elements, a top-k of the kept and a sort
    took 10.6 ms; of the dropped, and a mask, 4.5)."""
    magnitudes = values.abs()
    if 2 * count <= index.numel():
        top = magnitudes.topk(count, sorted=False).indices.sort().values
        return index.index_select(0, top), values.index_select(0, top)
    drop = magnitudes.topk(index.numel() - count, largest=False, sorted=False).indices
    keep = torch.ones_like(index, dtype=torch.bool)
    keep[drop] = False
    kept = keep.nonzero().squeeze(1)  # then two gathers: faster than two boolean indexings
    return index.index_select(0, kept), values.index_select(0, kept)


def top_count(v: Tensor, count: int) -> Scan | None:
    """The ``count`` elements of largest magnitude of ``v``, as ``keep_largest`` keeps them
    from a scan (moved by the largest tau they all reach, one chunk): its exact top-k, for a
    small ``v``. None when the top-k holds a zero, a NaN or an infinity, or its tau is out of
    range: the caller then scans, which leaves those out.
    """
    flat = check_flat(v)
    if isinstance(count, bool) or not isinstance(count, int) or not 0 < count <= flat.numel():
        raise ValueError(f"count={count!r}; expected an int in [1, {flat.numel()}] (elements "
                         f"to keep)")
    magnitude = flat.abs()
    top = magnitude.topk(count, sorted=False)
    peaks = top.values.max().reshape(1)  # the largest kept is the largest: the chunk's peak
    smallest, largest = torch.cat([top.values.min().reshape(1), peaks]).tolist()
    if not (smallest > 0 and math.isfinite(largest)):
        return None
    try:
        mantissa, exponent = quantize_threshold(smallest, flat.dtype, round_down=True)
    except ValueError:  # below the dtype's range (with its half step)
        return None
    if not largest < math.ldexp(1.0, exponent + precision_bits(flat.dtype)):
        return None  # an element past the exact bound: the scan leaves it out
    index = top.indices.sort().values
    return Scan(mantissa, exponent, index, flat.index_select(0, index), peaks, flat.numel())


def message_steps(found: Scan) -> Steps:
    """The steps of a sparse message encoded from ``found``, without parsing its payload."""
    return found.indices, found.positive


def check_flat(v: Tensor) -> Tensor:
    """``v`` as one flat float tensor (TypeError for anything else)."""
    if not isinstance(v, Tensor) or not v.is_floating_point():
        raise TypeError(f"expected a floating point tensor to encode, got "
                        f"{type(v).__name__} {getattr(v, 'dtype', '')}")
    return v.reshape(-1)
