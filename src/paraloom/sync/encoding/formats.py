"""The message: its formats, its header fields, and tau on its exact grid."""

from __future__ import annotations

import math
from enum import IntEnum
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["Encoded", "Format", "Steps", "quantize_threshold"]

ELEMENTS_PER_WORD = 16
"""Bitmap elements per int32 word (2 bits each)."""
MAX_THRESHOLD_NUMEL = 2**31 - 2  # 1-based signed int32 indices
GAP_MAX = 2**15 - 1
GAP_ESCAPE = -(2**15)  # advances GAP_MAX without moving an element


class Format(IntEnum):
    """The three message formats (see the package docstring)."""

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



Steps = tuple[Tensor, Tensor]
"""A sparse message's steps: ascending flat indices (int64), and whether each step is +."""


def precision_bits(dtype: torch.dtype) -> int:
    """Significand bits of a float dtype, implicit bit included (24 for float32)."""
    return 1 - round(math.log2(torch.finfo(dtype).eps))


def _tau_bits(dtype: torch.dtype) -> int:
    """Significant bits kept in tau: enough for smooth adaptation, few enough for exactness."""
    return min(8, max(1, precision_bits(dtype) - 8))


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
