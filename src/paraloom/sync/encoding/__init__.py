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

from paraloom.sync.encoding.decode import (
    add_at_,
    add_at_flat_,
    decode,
    decode_into,
    fill_at_flat_,
    moved_index,
    per_tensor,
)
from paraloom.sync.encoding.encode import (
    bitmap_encode,
    choose_format,
    empty_message,
    encode,
    encode_scan,
    gap16_encode,
    threshold_encode,
)
from paraloom.sync.encoding.formats import Encoded, Format, Steps, quantize_threshold
from paraloom.sync.encoding.scan import (
    EXACT_TOP_NUMEL,
    SCAN_CHUNK,
    Scan,
    full_step_mask,
    keep_largest,
    message_steps,
    scan,
    scan_chunk,
    top_count,
)

__all__ = [
    "Format", "Encoded", "Scan", "SCAN_CHUNK", "quantize_threshold", "full_step_mask",
    "scan", "scan_chunk", "choose_format", "threshold_encode", "bitmap_encode", "encode",
    "encode_scan", "decode", "empty_message", "moved_index", "decode_into", "per_tensor",
    "add_at_", "add_at_flat_", "fill_at_flat_", "gap16_encode", "Steps", "message_steps",
    "keep_largest", "top_count", "EXACT_TOP_NUMEL",
]
