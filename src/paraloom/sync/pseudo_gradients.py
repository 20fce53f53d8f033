"""Pure functions on DiLoCo's pseudo-gradients: top-k selection with low-bit values, and the sum
of every replica's selection. Error feedback (the residual) is the caller's state.

A message of ``k`` entries holds their positions as 16-bit offsets within blocks of 65,536
entries (in order, with one int32 count of entries per block), and ``k`` values in ``values``
(``"fp32"``, ``"fp16"``, or ``"int8"``: round to nearest on a scale of the largest magnitude /
127, one fp32 scale per message). Every replica's message has the same size, so one all-gather
moves them: ``k * (2 + value bytes) + 4 * blocks + 4`` bytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["BLOCK", "VALUE_FORMATS", "Selection", "TopK", "check_encoding", "decoded", "entries",
           "flat_difference", "message_bytes", "select", "sum_selections"]

BLOCK = 1 << 16
"""Entries per block: an offset within one fits in 16 bits."""

VALUE_FORMATS = {"fp32": 4, "fp16": 2, "int8": 1}
"""Value format -> bytes per value on the wire."""


def check_encoding(density: object, values: object) -> None:
    """A ``ValueError`` naming ``density`` or ``values`` when either is out of range."""
    if isinstance(density, bool) or not isinstance(density, float | int) or \
            not 0 < density <= 1:
        raise ValueError(f"density={density!r}; expected a fraction in (0, 1] of each "
                         "pseudo-gradient to send (1.0: all of it, dense)")
    if values not in VALUE_FORMATS:
        raise ValueError(f"values={values!r}; expected one of {sorted(VALUE_FORMATS)}")


@dataclass(frozen=True)
class TopK:
    """How a pseudo-gradient travels: its ``density`` largest-magnitude entries (the rest stay
    in the sender's residual and go out later: error feedback), each value as ``values``
    ("int8" with one scale per message, "fp16" or "fp32"), positions as 16-bit offsets.

    The defaults are ``training_mode="diloco"``'s: 5% of the entries in int8, about 3.1 bytes
    per sent entry. ``density=1.0`` sends everything, dense, in fp32 (``values`` unused).
    Raises ``ValueError`` for a density outside (0, 1] or an unknown value format.
    """

    density: float = 0.05
    values: str = "int8"

    def __post_init__(self) -> None:
        check_encoding(self.density, self.values)

    @property
    def dense(self) -> bool:
        """Whether everything is sent (no selection, no residual)."""
        return self.density >= 1


@dataclass(frozen=True)
class Selection:
    """One replica's message: where its entries are (``offsets`` within blocks, int16 holding
    offset - 32768, ascending; ``counts`` per block, int32), their wire values, and the fp32
    scale that turns int8 values back into numbers (1.0 for float formats)."""

    offsets: Tensor
    counts: Tensor
    values: Tensor
    scale: Tensor

    @property
    def index(self) -> Tensor:
        """The flat positions of the entries (int64)."""
        blocks = torch.repeat_interleave(
            torch.arange(self.counts.numel(), device=self.counts.device) * BLOCK,
            self.counts.long())
        return blocks + self.offsets.long() + 32768


def flat_difference(start: Sequence[Tensor], now: Sequence[Tensor]) -> Tensor:
    """The pseudo-gradient ``start - now`` of each pair, flat, in float32 (float64 when any
    ``start`` tensor is float64); both sides are cast to that dtype before subtracting, so a
    half-precision model loses nothing to the difference."""
    wide = any(t.dtype == torch.float64 for t in start)
    dtype = torch.float64 if wide else torch.float32
    if not start:
        return torch.zeros(0, dtype=dtype)
    return torch.cat([(a.to(dtype) - b.to(dtype)).reshape(-1)
                      for a, b in zip(start, now, strict=True)])


def entries(numel: int, density: float) -> int:
    """How many entries a message of ``density`` carries out of ``numel`` (at least one)."""
    return max(1, min(numel, math.ceil(density * numel)))


def blocks(numel: int) -> int:
    """Blocks of ``BLOCK`` entries that ``numel`` entries span."""
    return max(1, math.ceil(numel / BLOCK))


def message_bytes(count: int, values: str, numel: int) -> int:
    """Bytes of one message of ``count`` entries out of ``numel``: offsets, values, the counts
    per block and the scale."""
    return count * (2 + VALUE_FORMATS[values]) + 4 * blocks(numel) + 4


_FP16_SAFE = 60000.0
"""The largest magnitude an fp16 message holds unscaled (fp16's largest is 65504; room for
the division's rounding)."""


def _encode(picked: Tensor, values: str) -> tuple[Tensor, Tensor]:
    if values == "fp32":
        return picked.float(), torch.ones((), device=picked.device)
    top = picked.abs().max() if picked.numel() else torch.zeros((), device=picked.device)
    if values == "fp16":  # scaled down only past fp16's range, where half() gave inf
        scale = torch.where(top > _FP16_SAFE, top / _FP16_SAFE, torch.ones_like(top)).float()
        return (picked / scale).half(), scale
    # All zeros: scale 1. A NaN or Inf gives a NaN scale, so it reaches every replica (and the
    # next loss fails as non-finite) instead of being rounded away here.
    scale = torch.where(top == 0, torch.ones_like(top), top / 127).float()
    if not torch.isfinite(scale):
        scale = torch.full_like(scale, float("nan"))
    return torch.round(picked / scale).clamp_(-127, 127).to(torch.int8), scale


def decoded(selection: Selection) -> Tensor:
    """The numbers a selection carries, in fp32."""
    return selection.values.float() * selection.scale


def select(full: Tensor, count: int, values: str) -> Selection:
    """The ``count`` largest-magnitude entries of flat ``full`` in ``values`` format (the
    values are sent as float32 at most)."""
    index = torch.topk(full.abs(), count, sorted=False).indices.sort().values
    counts = torch.bincount(index // BLOCK, minlength=blocks(full.numel())).to(torch.int32)
    offsets = (index % BLOCK - 32768).to(torch.int16)
    wire, scale = _encode(full[index].float(), values)
    return Selection(offsets, counts, wire, scale)


def sum_selections(selections: list[Selection], numel: int, device: torch.device) -> Tensor:
    """The dense sum of every replica's selection (entries chosen by several add up)."""
    total = torch.zeros(numel, dtype=torch.float32, device=device)
    for one in selections:
        total.index_add_(0, one.index, decoded(one))
    return total
