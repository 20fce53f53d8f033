"""Threshold algorithms (how tau moves from step to step) and residual post-processors.

Each replica holds its own copies (they are pickled into every worker), as in DL4J: the
residuals differ between replicas, so their thresholds may too. A threshold algorithm is a
small state object around a pure rule (``adapt_threshold``, ``sampled_quantile``); it is asked
for ``tau`` before each encode (``choose``, which may look at the residual) and told the fraction
of elements that message moved afterwards (``update``).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

from torch import Tensor

__all__ = [
    "ThresholdAlgorithm", "FixedThreshold", "AdaptiveThreshold", "TargetSparsityThreshold",
    "QuantileThreshold", "ResidualPostProcessor", "ResidualClipping", "adapt_threshold",
    "sampled_quantile", "clip_residual_", "DEFAULT_DECAY", "DEFAULT_DENSITY",
    "EXACT_COUNT_HEADROOM",
]

DEFAULT_DECAY = 0.5 ** (1 / 20)
"""DL4J's decay rate: tau changes by a factor of 2 in 20 steps of consistent pressure."""

DEFAULT_DENSITY = 1 / 320
"""``QuantileThreshold``'s default fraction of elements per message; with the 24-byte header a
worker sends about 1/300 of dense bytes or less."""


EXACT_COUNT_HEADROOM = 1.25
"""``QuantileThreshold(exact_count=True)`` samples tau at this many times its density, so that
the threshold selects at least the count wanted: the sampled count varied by 4% (LeNet) to 8%
(a transformer) from step to step."""


def adapt_threshold(tau: float, sparsity: float, low: float, high: float, decay: float) -> float:
    """DL4J's rule: lower tau when too few elements moved, raise it when too many, else keep it."""
    if sparsity < low:
        return tau * decay
    if sparsity > high:
        return tau / decay
    return tau


def sampled_quantile(v: Tensor, density: float, sample: int, offset: int = 0) -> float:
    """The magnitude that about ``density`` of ``v``'s elements reach, from a strided sample.

    The sample is every ``len(v) // sample``-th element from ``offset`` (mod the stride): no
    random numbers, so a resumed run picks the same tau. 0.0 when the sample is all zero;
    NaN or inf when the sample holds them (the caller keeps its previous tau).
    """
    flat = v.reshape(-1)
    stride = max(1, flat.numel() // sample)
    picked = flat[offset % stride::stride].abs()
    if picked.numel() == 0:
        return 0.0
    rank = min(picked.numel(), max(1, math.ceil(picked.numel() * (1 - density))))
    above = picked.numel() - rank + 1  # the rank-th smallest is the above-th largest
    if above * 64 <= picked.numel():  # a few largest: topk is ~4x faster than kthvalue
        return float(picked.topk(above).values[-1])
    return float(picked.kthvalue(rank).values)


def _positive(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}={value!r}; expected a number")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value!r}; expected a finite number > 0")
    return float(value)


def _fraction(name: str, value: object) -> float:
    value = _positive(name, value)
    if value >= 1:
        raise ValueError(f"{name}={value!r}; expected a fraction of elements in (0, 1)")
    return float(value)


def _decay(value: object) -> float:
    value = _positive("decay", value)
    if not 0.5 <= value < 1:
        raise ValueError(f"decay={value!r}; expected a factor in [0.5, 1), e.g. "
                         f"0.5 ** (1 / 20) = {DEFAULT_DECAY:.5f} (DL4J's default)")
    return float(value)


class ThresholdAlgorithm:
    """Base class: ``tau`` is the threshold for the next message; ``update`` moves it."""

    __slots__ = ("tau", "initial")

    def __init__(self, tau: float) -> None:
        self.tau = self.initial = _positive("tau", tau)

    def choose(self, residual: Tensor) -> float:
        """The tau for the message about to be encoded from ``residual`` (default: ``tau``)."""
        return self.tau

    def update(self, sparsity: float) -> float:
        """Observe the fraction of elements the last message moved; return the next tau."""
        return self.tau

    def message_count(self, numel: int) -> int | None:
        """How many elements of ``numel`` every message moves, when the algorithm fixes it
        (messages then have one size); None when the count follows tau."""
        return None

    def config(self) -> dict[str, Any]:
        """The settings (JSON-able), without the evolving tau."""
        return {"type": type(self).__name__, "initial": self.initial,
                **{name: getattr(self, name) for name in self._settings()}}

    def state_dict(self) -> dict[str, Any]:
        """The evolving state for a checkpoint: the current tau."""
        return {"tau": self.tau}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``'s output; a tau that is not > 0 raises ``ValueError``."""
        self.tau = _positive("tau", state["tau"])

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}"
                           for name in ("tau", *self._settings()))
        return f"{type(self).__name__}({fields})"

    def _settings(self) -> tuple[str, ...]:
        return ()


class FixedThreshold(ThresholdAlgorithm):
    """Always the same ``tau`` (required): every message moves each residual element of
    magnitude ``tau`` or more by one tau, whatever fraction of the elements that is (DL4J's
    ``FixedThresholdAlgorithm``). ``tau`` must be > 0 and finite, else ``ValueError``."""

    __slots__ = ()


class AdaptiveThreshold(ThresholdAlgorithm):
    """Moves tau by ``decay`` per step until the fraction of moved elements is in the band."""

    __slots__ = ("min_sparsity", "max_sparsity", "decay")

    def __init__(self, initial: float = 1e-3, min_sparsity: float = 1e-4,
                 max_sparsity: float = 1e-2, decay: float = DEFAULT_DECAY) -> None:
        super().__init__(initial)
        self.min_sparsity = _fraction("min_sparsity", min_sparsity)
        self.max_sparsity = _fraction("max_sparsity", max_sparsity)
        if self.min_sparsity > self.max_sparsity:
            raise ValueError(f"min_sparsity={min_sparsity!r} > max_sparsity={max_sparsity!r}; "
                             f"expected min_sparsity <= max_sparsity")
        self.decay = _decay(decay)

    def update(self, sparsity: float) -> float:
        self.tau = adapt_threshold(self.tau, sparsity, self.min_sparsity, self.max_sparsity,
                                   self.decay)
        return self.tau

    def _settings(self) -> tuple[str, ...]:
        return ("min_sparsity", "max_sparsity", "decay")


class TargetSparsityThreshold(ThresholdAlgorithm):
    """Moves tau by ``decay`` per step towards a single target fraction of moved elements."""

    __slots__ = ("sparsity", "decay")

    def __init__(self, sparsity: float = 1e-3, initial: float = 1e-3,
                 decay: float = DEFAULT_DECAY) -> None:
        super().__init__(initial)
        self.sparsity = _fraction("sparsity", sparsity)
        if self.sparsity > 1 / 16:
            warnings.warn(f"sparsity={sparsity!r} is above 1/16: the messages will be bitmaps, "
                          f"which cost the same whatever the sparsity; a target <= 1/16 sends "
                          f"less for the same bytes", stacklevel=2)
        self.decay = _decay(decay)

    def update(self, sparsity: float) -> float:
        self.tau = adapt_threshold(self.tau, sparsity, self.sparsity, self.sparsity, self.decay)
        return self.tau

    def _settings(self) -> tuple[str, ...]:
        return ("sparsity", "decay")


class QuantileThreshold(ThresholdAlgorithm):
    """tau is the residual's (1 - ``density``) quantile, estimated each step from a sample.

    Each message then moves about ``density`` of the elements, the largest ones, by tau: top-k
    selection as in Deep Gradient Compression, within DL4J's threshold format. The quantile is
    taken from ``sample`` evenly strided elements (the offset turns each step), so choosing
    costs a small fraction of the encode. ``initial`` is used only until the residual has a
    nonzero sample.

    ``exact_count=True`` makes it DGC's hierarchical top-k: tau is sampled at
    ``EXACT_COUNT_HEADROOM`` times the density, and the message keeps the largest
    ``round(density * numel)`` (at least one) of the elements it selects (``message_count``),
    each moved by the smallest kept magnitude (``encoding.keep_largest``). Every message then
    has one size, which lets replicas exchange them in one collective instead of two, and
    start the exchange ahead (shared gradients' ``overlap``).
    """

    __slots__ = ("density", "sample", "calls", "exact_count")

    def __init__(self, density: float = DEFAULT_DENSITY, initial: float = 1e-3,
                 sample: int = 65536, *, exact_count: bool = False) -> None:
        super().__init__(initial)
        self.density = _fraction("density", density)
        if not isinstance(exact_count, bool):
            raise TypeError(f"exact_count={exact_count!r}; expected True or False")
        self.exact_count = exact_count
        if isinstance(sample, bool) or not isinstance(sample, int) or sample < 16:
            raise ValueError(f"sample={sample!r}; expected an int >= 16 (elements sampled to "
                             f"estimate the quantile)")
        if sample * self.density < 4:
            raise ValueError(f"sample={sample} with density={density!r} keeps fewer than 4 "
                             f"sampled elements above tau; expected sample >= "
                             f"{math.ceil(4 / self.density)}")
        self.sample = sample
        self.calls = 0

    def choose(self, residual: Tensor) -> float:
        density = self.density
        if self.exact_count:
            density = min(0.5, density * EXACT_COUNT_HEADROOM)
        tau = sampled_quantile(residual, density, self.sample, self.calls)
        self.calls += 1
        if math.isfinite(tau) and tau > 0:
            self.tau = tau
        return self.tau

    def state_dict(self) -> dict[str, Any]:
        """The current tau and the sample offset's call count (the sample turns with it)."""
        return {"tau": self.tau, "calls": self.calls}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``'s output, so that a resumed run samples as the saved
        one would have."""
        super().load_state_dict(state)
        self.calls = int(state.get("calls", 0))

    def message_count(self, numel: int) -> int | None:
        """``round(density * numel)``, at least one (a model of fewer than ``0.5 / density``
        elements still trains)."""
        return max(1, round(self.density * numel)) if self.exact_count else None

    def _settings(self) -> tuple[str, ...]:
        return ("density", "sample", "exact_count")


def clip_residual_(residual: Tensor, limit: float) -> Tensor:
    """Clamp the residual to ``[-limit, limit]`` in place; returns it."""
    return residual.clamp_(-limit, limit)


class ResidualPostProcessor:
    """Base class: called on the residual after each encode; the default does nothing."""

    __slots__ = ()

    def process(self, residual: Tensor, tau: float, step: int) -> None:
        """Modify ``residual`` in place after the message for ``step`` was subtracted."""

    def bound(self, tau: float, step: int) -> float | None:
        """A magnitude that ``process`` leaves alone at this step: it changes no element of a
        part of the residual whose elements are all within it, so the caller may skip such
        parts (and pass ``process`` any part, not only the whole). None: no such promise
        (the default for a subclass that overrides ``process``; this no-op class changes
        nothing)."""
        return math.inf if type(self).process is ResidualPostProcessor.process else None

    def config(self) -> dict[str, Any]:
        """The settings (JSON-able)."""
        return {"type": type(self).__name__,
                **{name: getattr(self, name) for name in self._setting_names()}}

    def _setting_names(self) -> tuple[str, ...]:
        slots: tuple[str, ...] = getattr(self, "__slots__", ())
        return slots

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class ResidualClipping(ResidualPostProcessor):
    """Every ``frequency`` steps, clamp the residual to ``ratio * tau`` (Spark DL4J's default).

    This drops mass on purpose: a residual far above tau means updates arrive faster than the
    messages can carry them, and the stale surplus would otherwise be sent for many steps.
    """

    __slots__ = ("ratio", "frequency")

    def __init__(self, ratio: float = 5.0, frequency: int = 5) -> None:
        self.ratio = _positive("ratio", ratio)
        if self.ratio < 1:
            raise ValueError(f"ratio={ratio!r}; expected >= 1 (below 1 the clip would remove "
                             f"elements that are about to be sent)")
        if isinstance(frequency, bool) or not isinstance(frequency, int) or frequency < 1:
            raise ValueError(f"frequency={frequency!r}; expected an int >= 1 (steps between clips)")
        self.frequency = frequency

    def process(self, residual: Tensor, tau: float, step: int) -> None:
        limit = self.bound(tau, step)
        if limit != math.inf:
            clip_residual_(residual, limit)

    def bound(self, tau: float, step: int) -> float:
        """``ratio * tau`` on the steps that clip; no bound (inf) on the others."""
        return self.ratio * tau if step > 0 and step % self.frequency == 0 else math.inf

    def __repr__(self) -> str:
        return f"ResidualClipping(ratio={self.ratio!r}, frequency={self.frequency!r})"
