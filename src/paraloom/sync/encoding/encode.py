"""Encoding a residual's scan as a threshold, gap16 or bitmap message."""

from __future__ import annotations

import torch
from torch import Tensor

from paraloom.sync.encoding.formats import (
    ELEMENTS_PER_WORD,
    GAP_ESCAPE,
    GAP_MAX,
    MAX_THRESHOLD_NUMEL,
    Encoded,
    Format,
)
from paraloom.sync.encoding.scan import Scan, check_flat, full_step_mask, scan

__all__ = ["bitmap_encode", "choose_format", "empty_message", "encode", "encode_scan",
           "gap16_encode", "threshold_encode"]


def choose_format(count: int, numel: int, previous: Format,
                  sparse: Format = Format.THRESHOLD) -> Format:
    """Pick a format from the number of full steps, with DL4J's hysteresis (N/16 up, N/32 down).

    The bitmap is chosen once the ``sparse`` message (threshold: a word per step; gap16: half
    a word) would be no smaller than it; the encoder returns to sparse messages only when they
    would be less than half the bitmap's size, so the format does not flap. No format drops
    elements: there is no cap on ``count``.
    """
    bitmap_words = -(-numel // ELEMENTS_PER_WORD)
    sparse_words = -(-count // 2) if sparse == Format.GAP16 else count
    if previous == Format.BITMAP:
        return Format.BITMAP if 2 * sparse_words >= bitmap_words else sparse
    return Format.BITMAP if sparse_words >= bitmap_words else sparse


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
    pad = (-numel) % ELEMENTS_PER_WORD
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    shifts = 2 * torch.arange(ELEMENTS_PER_WORD, dtype=torch.int64, device=flat.device)
    words = (codes.view(-1, ELEMENTS_PER_WORD) << shifts).sum(dim=1)  # disjoint bits: sum == or
    # Reinterpret the unsigned 32-bit words as int32 (two's complement).
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


def _gap16_payload(index: Tensor, positive: Tensor, numel: int) -> Tensor:
    gaps = torch.diff(index, prepend=index.new_full((1,), -1))
    if numel <= GAP_MAX:  # no gap can need an escape: no pass (and no host sync) to find one
        entries = torch.where(positive, gaps, -gaps)
    else:
        entries = _escaped(gaps, positive)
    if entries.numel() % 2:
        entries = torch.cat([entries, entries.new_zeros(1)])  # the padding entry
    return entries.to(torch.int16).view(torch.int32)


def _escaped(gaps: Tensor, positive: Tensor) -> Tensor:
    """Signed gap entries with escape entries before each gap over ``GAP_MAX``."""
    escapes = (gaps - 1) // GAP_MAX  # before each entry, so that what is left fits int16
    last = gaps - escapes * GAP_MAX
    entries = torch.where(positive, last, -last)
    if bool((escapes > 0).any()):
        ends = (escapes + 1).cumsum(0)
        spread = torch.full((int(ends[-1]),), GAP_ESCAPE, dtype=torch.int64,
                            device=gaps.device)
        spread[ends - 1] = entries
        entries = spread
    return entries


def _check_indexable(numel: int) -> None:
    if numel > MAX_THRESHOLD_NUMEL:
        raise ValueError(f"{numel} elements do not fit int32 indices; expected at most "
                         f"{MAX_THRESHOLD_NUMEL}: encode the tensor in chunks")


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
    flat = check_flat(v)
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
                       _gap16_payload(found.indices, found.positive, flat.numel()))
    _check_indexable(flat.numel())
    return Encoded(Format.THRESHOLD, found.mantissa, found.exponent, 1, flat.numel(), count,
                   _threshold_payload(found.indices, found.positive))


def empty_message(numel: int, device: torch.device | str = "cpu") -> Encoded:
    """A message that moves nothing (what an idle replica sends)."""
    payload = torch.empty(0, dtype=torch.int32, device=device)
    return Encoded(Format.THRESHOLD, 1, 0, 1, numel, 0, payload)
