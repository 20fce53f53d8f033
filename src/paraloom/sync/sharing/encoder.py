"""The message a replica makes of its residual each step, and what it counts about them.

``MessageEncoder`` asks its threshold algorithm for tau, scans the residual, keeps the
largest elements when the algorithm fixes the count, encodes the message (threshold, gap16 or
bitmap, see ``paraloom.sync.encoding``) and lets the residual post-processor act. It keeps the
format the last message took (the encoder switches with hysteresis), the bitmap's half-step
side, and the counters that ``SharedGradients.stats()`` reports.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch import Tensor

from paraloom.sync.encoding import (
    EXACT_TOP_NUMEL,
    Encoded,
    Format,
    Scan,
    Steps,
    add_at_,
    encode_scan,
    keep_largest,
    message_steps,
    scan,
    top_count,
)
from paraloom.sync.encoding.formats import precision_bits
from paraloom.sync.sharing.recipe import SharingRecipe
from paraloom.sync.sharing.view import add_range_
from paraloom.sync.thresholds import ThresholdAlgorithm

__all__ = ["MessageEncoder"]


class MessageEncoder:
    """Encodes one replica's residual as its message, step after step (state in slots)."""

    __slots__ = ("recipe", "threshold_algorithm", "format", "half_sign", "last_tau",
                 "last_sparsity", "sparsity_sum", "encoded_steps", "bitmap_steps",
                 "warned_bound")

    def __init__(self, recipe: SharingRecipe) -> None:
        self.recipe = recipe
        self.threshold_algorithm: ThresholdAlgorithm = recipe.new_threshold_algorithm()
        """This replica's own copy: its tau follows its own residual."""
        self.format = Format.BITMAP if recipe.encoding == "bitmap" else Format.THRESHOLD
        """The last message's format (the next one switches from it with hysteresis)."""
        self.half_sign = 1
        """The side of the next bitmap's half steps: it alternates between bitmaps."""
        self.last_tau = self.threshold_algorithm.tau
        self.last_sparsity = 0.0
        self.sparsity_sum = 0.0
        self.encoded_steps = 0
        self.bitmap_steps = 0
        self.warned_bound = False

    def encode(self, residual: Tensor) -> tuple[Encoded, Scan, Steps | None]:
        """The message for ``residual`` (which it does not change), the scan it carries, and
        its steps when the scan gives them (a sparse message: no need to parse it back)."""
        forced = self.recipe.forced_format()
        # A bitmap moves every element >= tau: the count applies to sparse messages only.
        count = None if forced == Format.BITMAP else \
            self.threshold_algorithm.message_count(residual.numel())
        # A small residual: its exact top-k, what the scan and keep_largest would keep.
        found = top_count(residual, count) \
            if count is not None and residual.numel() <= EXACT_TOP_NUMEL else None
        if found is None:
            found = scan(residual, self.threshold_algorithm.choose(residual))
        else:
            count = None  # kept already (a capacity overrun below sets it again)
        capacity = self.recipe.capacity(residual.numel())
        while True:
            if count is not None:
                found = keep_largest(found, count)
            msg = encode_scan(residual, found, previous=self.format, half_sign=self.half_sign,
                              format=forced, sparse=self.recipe.sparse_format())
            if capacity is None or msg.payload.numel() <= capacity:
                break
            # Gap16's escape entries (for gaps over 32,767) took room: keep fewer elements.
            count = max(0, (found.indices.numel() if count is None else count)
                        - 2 * (msg.payload.numel() - capacity))
        steps = None if msg.format == Format.BITMAP else message_steps(found)
        self._warn_if_past_the_bound(found, residual.dtype)
        return msg, found, steps

    def _warn_if_past_the_bound(self, found: Scan, dtype: torch.dtype) -> None:
        """Warn (once) when elements reach 2**24 times tau (float32): a step of tau cannot
        be taken from them exactly, so they are never sent and never train."""
        if self.warned_bound or not found.peaks.numel():
            return
        upper = math.ldexp(1.0, found.exponent + precision_bits(dtype))
        peak = float(found.peaks.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).max())
        if peak >= upper:
            self.warned_bound = True
            warnings.warn(f"shared_gradients: residual elements reach {peak:.3g}, past "
                          f"2**{precision_bits(dtype)} times tau ({found.tau:.3g}): a step of "
                          "tau cannot be taken from them exactly, so they are never sent and "
                          "those parameters do not train; raise the threshold (a FixedThreshold"
                          " near 1e-3 of the updates' size, or a QuantileThreshold)",
                          RuntimeWarning, stacklevel=1)

    def post_process(self, residual: Tensor, found: Scan, tau: float, step: int,
                     bounds: Tensor, view: list[Tensor] | None = None,
                     reach: float = 1.0) -> None:
        """Let the post-processor act at sync step ``step``, on the chunks it can change only
        where it says which: the message only lowered magnitudes, so a chunk whose peak is
        within the bound is untouched. What it takes from the residual, ``reach`` times,
        leaves the local ``view`` too (``bounds``: the parameters' cumulative sizes)."""
        post = self.recipe.residual_post_processor
        if post is None:
            return
        bound = post.bound(tau, step)
        if bound == math.inf:  # nothing to clip (a non-finite update fails the step anyway)
            return
        chunks = [(0, residual.numel())] if bound is None else \
            [(i * found.chunk, min((i + 1) * found.chunk, residual.numel()))
             for i in torch.nonzero(~(found.peaks <= bound)).reshape(-1).tolist()]  # NaN too
        dense = view is not None and all(p.is_contiguous() for p in view)
        for begin, end in chunks:
            part = residual[begin:end]
            if view is None:
                post.process(part, tau, step)
                continue
            before = part.clone()
            post.process(part, tau, step)
            taken = before.sub_(part)
            if dense:  # a pass over the chunk: cheaper than finding the few elements it took
                add_range_(view, begin, taken, -reach)
                continue
            index = torch.nonzero(taken).reshape(-1)
            if index.numel():
                add_at_(view, bounds, index + begin, taken.index_select(0, index) * -reach)

    def record(self, msg: Encoded) -> None:
        """Count a message made (its format is where the next one starts from)."""
        self.format = msg.format
        if msg.format == Format.BITMAP:
            self.half_sign = -self.half_sign  # alternate the half step's side
            self.bitmap_steps += 1
        self.last_tau = msg.tau
        self.last_sparsity = msg.moved / msg.numel
        self.sparsity_sum += self.last_sparsity
        self.encoded_steps += 1

    def stats(self) -> dict[str, float]:
        """tau and sparsity (fraction of elements moved) of the last message, their mean, and
        the share of bitmaps."""
        steps = max(1, self.encoded_steps)
        return {"tau": self.last_tau, "sparsity": self.last_sparsity,
                "mean_sparsity": self.sparsity_sum / steps,
                "bitmap_fraction": self.bitmap_steps / steps}

    def state_dict(self) -> dict[str, Any]:
        return {"threshold": self.threshold_algorithm.state_dict(), "format": int(self.format),
                "half_sign": self.half_sign, "encoded_steps": self.encoded_steps,
                "bitmap_steps": self.bitmap_steps, "sparsity_sum": self.sparsity_sum}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "threshold" in state:
            self.threshold_algorithm.load_state_dict(state["threshold"])
            self.last_tau = self.threshold_algorithm.tau
        self.format = Format(int(state.get("format", Format.THRESHOLD)))
        self.half_sign = int(state.get("half_sign", 1))
        self.encoded_steps = int(state.get("encoded_steps", 0))
        self.bitmap_steps = int(state.get("bitmap_steps", 0))
        self.sparsity_sum = float(state.get("sparsity_sum", 0.0))
