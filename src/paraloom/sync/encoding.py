"""Threshold, gap16 and bitmap encoding of update residuals: pure functions on tensors.

A message moves each selected element of a residual ``v`` by a fixed step ``tau`` towards zero
and tells the peers to add that step to their parameters. Two formats exist, as in DL4J:

* **threshold** (sparse): one int32 per element with ``|v| >= tau``: ``+(i + 1)`` for ``+tau``,
  ``-(i + 1)`` for ``-tau`` (1-based so that the sign survives index 0), in ascending order.
* **bitmap** (dense): 2 bits per element, 16 elements per int32 word: code 0 = nothing,
  1 = ``+tau``, 2 = ``-tau``, 3 = a half step ``half_sign * tau / 2`` for ``tau/2 <= |v| < tau``
  on the side named by ``half_sign``. The caller alternates ``half_sign`` between messages, so
  positive and negative residuals get the same treatment (DL4J only ever sends ``-tau/2``).

A third format, **gap16**, carries the threshold message's steps in half its bytes: one int16
per element, ``+gap`` for ``+tau`` and ``-gap`` for ``-tau``, ``gap`` the distance from the
previous element moved (from -1 for the first), two per int32 word; ``-32768`` advances 32767
without moving anything (for gaps longer than that), ``0`` pads the last word. At a density
of 1/160 it costs what a threshold message costs at 1/320.

Exactness. ``tau`` is rounded to ``s`` significant bits (8 for float32/float64, 3 for float16,
1 for bfloat16: at most 0.4% away in float32), ``tau = mantissa * 2**exponent`` with an odd
mantissa. Then ``v - tau`` is exact in floating point whenever ``tau <= |v| < 2**(exponent + p)``
(``p`` = significand bits: 24 for float32, 53 float64, 11 float16, 8 bfloat16): ``tau`` is a
multiple of ``ulp(v)`` there, and the difference, smaller than ``v``, fits ``p`` bits. That
bound is at least ``2**(p - s) * tau``: 65,536 tau in float32, 256 tau in float16. Half steps
are exact by Sterbenz's lemma. Elements beyond the bound (and NaN/inf) are never encoded: a
step would not be exact there (and far enough out would not change them at all), so they stay
in the residual. Hence, for every input, ``decoded + (v - decoded) == v`` holds exactly,
element by element, in both formats.

Speed. ``scan`` finds the elements a full step moves in one pass over ``v``, chunk by chunk
(``SCAN_CHUNK`` elements, so that each chunk and its scratch stay in the CPU's cache between
the few operations on it), with each chunk's largest magnitude on the side: the caller learns
from those peaks whether anything is non-finite and which chunks a clip can touch, without
more passes over a tensor the size of the model.

The encoders do not modify ``v``: the caller subtracts the message with ``decode(msg, v,
sign=-1)``, so choosing a format can never lose residual mass (DL4J's sparse pass mutated the
residual and then discarded its message when it switched to the bitmap).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from enum import IntEnum
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "Format", "Encoded", "Scan", "SCAN_CHUNK", "quantize_threshold", "full_step_mask",
    "scan", "scan_chunk", "choose_format", "threshold_encode", "bitmap_encode", "encode",
    "encode_scan", "decode", "empty_message", "moved_index", "decode_into", "per_tensor",
    "add_at_", "add_at_flat_", "fill_at_flat_", "gap16_encode", "Steps", "message_steps",
    "keep_largest",
]

SCAN_CHUNK = 1 << 19
"""Elements per chunk of ``scan``: 2 MiB of float32, which stays in a CPU's cache (with the
scratch, and with two more such chunks in the sharing step's update pass) between operations:
on a 37.8M-element residual 2^18 to 2^20 ran within 10% of each other, 2^16 25% slower."""

_ELEMENTS_PER_WORD = 16
_MAX_THRESHOLD_NUMEL = 2**31 - 2  # 1-based signed int32 indices
_GAP_MAX = 2**15 - 1
_GAP_ESCAPE = -(2**15)  # advances _GAP_MAX without moving an element


class Format(IntEnum):
    """The two message formats."""

    THRESHOLD = 1
    BITMAP = 2
    GAP16 = 3


class Encoded(NamedTuple):
    """One encoded message: an int32 ``payload`` plus the header fields needed to decode it."""

    format: Format
    mantissa: int
    """The step is ``tau = mantissa * 2.0 ** exponent`` (an odd mantissa of at most 8 bits)."""
    exponent: int
    half_sign: int
    """Bitmap only: the sign (+1 or -1) of this message's half steps."""
    numel: int
    """Length of the flat tensor the message encodes."""
    moved: int
    """Elements moved by a full ``tau`` step (the sparsity numerator)."""
    payload: Tensor

    @property
    def tau(self) -> float:
        """The step size as a float."""
        return math.ldexp(self.mantissa, self.exponent)


def _precision(dtype: torch.dtype) -> int:
    """Significand bits of a float dtype, implicit bit included (24 for float32)."""
    return 1 - round(math.log2(torch.finfo(dtype).eps))


def _tau_bits(dtype: torch.dtype) -> int:
    """Significant bits kept in tau: enough for smooth adaptation, few enough for exactness."""
    return min(8, max(1, _precision(dtype) - 8))


def quantize_threshold(tau: float, dtype: torch.dtype = torch.float32, *,
                       round_down: bool = False) -> tuple[int, int]:
    """Round ``tau`` to ``(mantissa, exponent)``, ``mantissa`` odd, checked against ``dtype``:
    to the nearest value on the grid, or the largest one not above ``tau`` (``round_down``)."""
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not math.isfinite(tau) \
            or tau <= 0:
        raise ValueError(f"tau={tau!r}; expected a finite number > 0")
    if not dtype.is_floating_point:
        raise TypeError(f"dtype={dtype}; expected a floating point dtype")
    bits = _tau_bits(dtype)
    fraction, exponent = math.frexp(tau)  # tau = fraction * 2**exponent, fraction in [0.5, 1)
    scaled = math.ldexp(fraction, bits)
    mantissa, exponent = math.floor(scaled) if round_down else round(scaled), exponent - bits
    while mantissa % 2 == 0:  # normalize: 2**exponent is then tau's lowest set bit
        mantissa, exponent = mantissa // 2, exponent + 1
    info = torch.finfo(dtype)
    smallest = info.tiny * info.eps  # smallest subnormal
    # The half step tau/2 must be representable too, and tau must not overflow.
    if math.ldexp(1.0, exponent - 1) < smallest or math.ldexp(mantissa, exponent) > info.max:
        raise ValueError(f"tau={tau!r} is out of {dtype}'s range (with its half step); "
                         f"expected tau in [{2 ** bits * smallest:.3g}, {info.max:.3g}]")
    return mantissa, exponent


def full_step_mask(v: Tensor, mantissa: int, exponent: int,
                   scratch: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Elements a full step moves exactly: ``tau <= |v| < 2**(exponent + p)``, never NaN/inf.

    Comparisons on ``v`` itself, not on ``|v|``: no float temporary the size of ``v``. Two
    bool tensors shaped like ``v`` given as ``scratch`` are reused instead of allocated (the
    mask returned is the first).
    """
    # Python floats compare in v's dtype; a bound above the dtype's range becomes inf (no bound).
    tau = math.ldexp(mantissa, exponent)
    upper = math.ldexp(1.0, exponent + _precision(v.dtype))
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
    flat = _check_flat(v)
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
        torch.amax(magnitude[:size], dim=0, out=peaks[i])
        torch.ge(magnitude[:size], step, out=full[:size])
        index = torch.nonzero(full[:size]).reshape(-1)
        if index.numel():
            found.append(index.add_(begin))
    index = torch.cat(found) if found else torch.empty(0, dtype=torch.int64, device=flat.device)
    values = flat.index_select(0, index)
    upper = math.ldexp(1.0, exponent + _precision(flat.dtype))
    if index.numel() and not bool(peaks.max() < upper):  # inf, NaN, or past the exact bound
        exact = values.abs() < upper
        index, values = index[exact], values[exact]
    return Scan(mantissa, exponent, index, values, peaks, chunk)


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
    upper = math.ldexp(1.0, exponent + _precision(dtype))
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


def choose_format(count: int, numel: int, previous: Format,
                  sparse: Format = Format.THRESHOLD) -> Format:
    """Pick a format from the number of full steps, with DL4J's hysteresis (N/16 up, N/32 down).

    The bitmap is chosen once the ``sparse`` message (threshold: a word per step; gap16: half
    a word) would be no smaller than it; the encoder returns to sparse messages only when they
    would be less than half the bitmap's size, so the format does not flap. No format drops
    elements: there is no cap on ``count``.
    """
    bitmap_words = -(-numel // _ELEMENTS_PER_WORD)
    sparse_words = -(-count // 2) if sparse == Format.GAP16 else count
    if previous == Format.BITMAP:
        return Format.BITMAP if 2 * sparse_words >= bitmap_words else sparse
    return Format.BITMAP if sparse_words >= bitmap_words else sparse


def _check_flat(v: Tensor) -> Tensor:
    if not isinstance(v, Tensor) or not v.is_floating_point():
        raise TypeError(f"expected a floating point tensor to encode, got "
                        f"{type(v).__name__} {getattr(v, 'dtype', '')}")
    return v.reshape(-1)


def _threshold_payload(index: Tensor, positive: Tensor) -> Tensor:
    one_based = index + 1
    return torch.where(positive, one_based, -one_based).to(torch.int32)


def _bitmap_payload(flat: Tensor, full: Tensor, tau: float, half_sign: int) -> Tensor:
    numel = flat.numel()
    codes = torch.zeros(numel, dtype=torch.int64, device=flat.device)
    codes[full & (flat > 0)] = 1
    codes[full & (flat < 0)] = 2
    signed = flat * half_sign  # exact: a sign flip
    codes[(signed >= tau / 2) & (signed < tau)] = 3
    pad = (-numel) % _ELEMENTS_PER_WORD
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    shifts = 2 * torch.arange(_ELEMENTS_PER_WORD, dtype=torch.int64, device=flat.device)
    words = (codes.view(-1, _ELEMENTS_PER_WORD) << shifts).sum(dim=1)  # disjoint bits: sum == or
    # Reinterpret the unsigned 32-bit words as int32 (two's complement).
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


def _gap16_payload(index: Tensor, positive: Tensor) -> Tensor:
    gaps = torch.diff(index, prepend=index.new_full((1,), -1))
    escapes = (gaps - 1) // _GAP_MAX  # before each entry, so that what is left fits int16
    last = gaps - escapes * _GAP_MAX
    entries = torch.where(positive, last, -last)
    if bool((escapes > 0).any()):
        ends = (escapes + 1).cumsum(0)
        spread = torch.full((int(ends[-1]),), _GAP_ESCAPE, dtype=torch.int64,
                            device=index.device)
        spread[ends - 1] = entries
        entries = spread
    if entries.numel() % 2:
        entries = torch.cat([entries, entries.new_zeros(1)])  # the padding entry
    return entries.to(torch.int16).view(torch.int32)


def _steps(format: Format, payload: Tensor) -> tuple[Tensor, Tensor]:
    """The flat indices (int64, ascending) a sparse message moves, and whether each step is +."""
    if format == Format.GAP16:
        return _gap16_steps(payload)
    return payload.abs().to(torch.int64) - 1, payload > 0


def _gap16_steps(payload: Tensor) -> tuple[Tensor, Tensor]:
    """The ascending flat indices (int64) a gap16 payload moves, and whether each step is +."""
    entries = payload.contiguous().view(torch.int16).to(torch.int64)
    escape = entries == _GAP_ESCAPE
    index = torch.where(escape, _GAP_MAX, entries.abs()).cumsum(0) - 1
    keep = ~escape & (entries != 0)
    return index[keep], entries[keep] > 0


def _check_indexable(numel: int) -> None:
    if numel > _MAX_THRESHOLD_NUMEL:
        raise ValueError(f"{numel} elements do not fit int32 indices; expected at most "
                         f"{_MAX_THRESHOLD_NUMEL}: encode the tensor in chunks")


def threshold_encode(v: Tensor, tau: float) -> Encoded:
    """Sparse message: a signed 1-based int32 index for each element with ``|v| >= tau``."""
    return encode_scan(v, scan(v, tau), format=Format.THRESHOLD)


def gap16_encode(v: Tensor, tau: float) -> Encoded:
    """The threshold message's steps as int16 gaps: about half the bytes."""
    return encode_scan(v, scan(v, tau), format=Format.GAP16)


def bitmap_encode(v: Tensor, tau: float, half_sign: int = 1) -> Encoded:
    """Dense message: 2 bits per element (``+tau``, ``-tau``, or a half step on one side)."""
    return encode_scan(v, scan(v, tau), half_sign=half_sign, format=Format.BITMAP)


def encode(v: Tensor, tau: float, *, previous: Format = Format.THRESHOLD,
           half_sign: int = 1) -> Encoded:
    """Encode in the format ``choose_format`` picks, given the format of the previous message."""
    return encode_scan(v, scan(v, tau), previous=previous, half_sign=half_sign)


def encode_scan(v: Tensor, found: Scan, *, previous: Format = Format.THRESHOLD,
                half_sign: int = 1, format: Format | None = None,
                sparse: Format = Format.THRESHOLD) -> Encoded:
    """The message for ``v`` from its ``scan``: in ``format``, or the one ``choose_format``
    picks (``sparse`` or the bitmap) given the previous message's format."""
    if half_sign not in (1, -1):
        raise ValueError(f"half_sign={half_sign!r}; expected 1 or -1")
    flat = _check_flat(v)
    count = found.indices.numel()
    if format is None:
        format = choose_format(count, flat.numel(), Format(previous), sparse)
    if format == Format.BITMAP:  # dense: the rare case, a pass more
        full = full_step_mask(flat, found.mantissa, found.exponent)
        payload = _bitmap_payload(flat, full, found.tau, half_sign)
        return Encoded(Format.BITMAP, found.mantissa, found.exponent, half_sign, flat.numel(),
                       count, payload)
    if format == Format.GAP16:
        return Encoded(Format.GAP16, found.mantissa, found.exponent, 1, flat.numel(), count,
                       _gap16_payload(found.indices, found.positive))
    _check_indexable(flat.numel())
    return Encoded(Format.THRESHOLD, found.mantissa, found.exponent, 1, flat.numel(), count,
                   _threshold_payload(found.indices, found.positive))


def empty_message(numel: int, device: torch.device | str = "cpu") -> Encoded:
    """A message that moves nothing (what an idle replica sends)."""
    payload = torch.empty(0, dtype=torch.int32, device=device)
    return Encoded(Format.THRESHOLD, 1, 0, 1, numel, 0, payload)


def _bitmap_codes(msg: Encoded) -> Tensor:
    words = msg.payload.to(torch.int64) & 0xFFFFFFFF
    shifts = 2 * torch.arange(_ELEMENTS_PER_WORD, dtype=torch.int64, device=words.device)
    return ((words.unsqueeze(1) >> shifts) & 3).reshape(-1)[: msg.numel]


Steps = tuple[Tensor, Tensor]
"""A sparse message's steps: ascending flat indices (int64), and whether each step is +."""


def _sparse_steps(msg: Encoded, steps: Steps | None, device: torch.device) -> Steps:
    if steps is not None:
        if msg.format == Format.BITMAP:
            raise ValueError("steps= given for a bitmap message; expected them only for a "
                             "threshold or gap16 message (the bitmap has half steps too)")
        return steps[0].to(device), steps[1].to(device)
    return _steps(msg.format, msg.payload.to(device))


def message_steps(found: Scan) -> Steps:
    """The steps of a sparse message encoded from ``found``, without parsing its payload."""
    return found.indices, found.positive


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
