"""SharingRecipe: every option of update sharing in one frozen value, validated once.

The two presets and what each option defaults to in them are in ``_PRESETS``, the one place
those defaults are written; an option left at None takes its preset's value when the recipe
is built, so a recipe reads back complete (``print(SharingRecipe())`` shows every choice).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

from paraloom.sync.encoding import Format
from paraloom.sync.thresholds import (
    AdaptiveThreshold,
    QuantileThreshold,
    ResidualClipping,
    ResidualPostProcessor,
    ThresholdAlgorithm,
)

__all__ = ["RecipeOptions", "SharingRecipe"]

DGC_DENSITY = 1 / 160
"""The dgc preset's fraction of elements per message. Its gap16 messages take half a word per
element, so with the headers a worker sends under 1/300 of all-reduce's bytes: the same bytes
as threshold messages at 1/320, for twice the elements (digits16, 6 epochs: 81.8% against
74.8% test accuracy, 5 seeds)."""

ENCODINGS = ("auto", "threshold", "bitmap", "gap16")
_FORCED = {"bitmap": Format.BITMAP, "threshold": Format.THRESHOLD, "gap16": Format.GAP16}
"""The format each ``encoding=`` but "auto" forces."""
_COMBINES = ("mean", "sum")
_GRADIENTS_AT = ("local", "shared")


class _Preset(NamedTuple):
    """What a preset sets for the options left at None."""

    threshold_algorithm: Callable[[], ThresholdAlgorithm]
    residual_post_processor: ResidualPostProcessor | None
    combine: str
    gradients_at: str
    sparse_format: Format


_PRESETS = {
    # DGC's top-k at the dense recipe's learning rate: exact-count quantile, gap16 messages,
    # updates averaged, gradients at the local view, local clipping at 2 tau.
    "dgc": _Preset(partial(QuantileThreshold, DGC_DENSITY, exact_count=True),
                   ResidualClipping(2.0, 1), "mean", "local", Format.GAP16),
    # DL4J's ParallelWrapper exactly: adaptive tau, threshold messages, updates summed.
    "dl4j": _Preset(AdaptiveThreshold, None, "sum", "shared", Format.THRESHOLD),
}


@dataclass(frozen=True)
class SharingRecipe:
    """How ``training_mode="shared_gradients"`` encodes, exchanges and applies updates.

    Pass it as ``ParallelWrapper(sharing=SharingRecipe(...))`` or
    ``SharedGradients(recipe=SharingRecipe(...))``; the same options also work as keywords of
    either (``ParallelWrapper(training_mode="shared_gradients", combine="sum")``). Every
    option left at None takes the preset's value (resolved when the recipe is built).

    Raises ``ValueError`` for an unknown preset, combine, gradients_at or encoding, or for
    ``overlap=True`` with ``gradients_at="shared"``; ``TypeError`` for a threshold algorithm or
    post-processor of the wrong type. ``overlap=True`` with messages of varying size is
    refused when the synchronizer meets the model (``SharedGradients.setup``).
    """

    preset: str = "dgc"
    """``"dgc"`` (the default: DGC's top-k, trains at the dense recipe's learning rate) or
    ``"dl4j"`` (DL4J's ParallelWrapper rules; needs a smaller learning rate)."""
    threshold_algorithm: ThresholdAlgorithm | None = None
    """How tau is chosen each step. dgc: ``QuantileThreshold(1/160, exact_count=True)`` (the
    largest 1/160 of the residual's elements, messages of one size); dl4j:
    ``AdaptiveThreshold()`` (tau moves by 2x per 20 steps to keep 1e-4..1e-2 moving). Each
    synchronizer steps its own copy."""
    residual_post_processor: ResidualPostProcessor | None = None
    """What is done to the residual after each message. dgc: ``ResidualClipping(2.0, 1)``
    (DGC's local clipping: a surplus beyond 2 tau is stale); dl4j: none.
    ``ResidualPostProcessor()``, the no-op base class, turns the dgc clipping off."""
    combine: str | None = None
    """``"mean"`` (dgc: every update divided by the number of replicas, as all-reduce
    averages, so learning rates carry over) or ``"sum"`` (dl4j: each update applied whole)."""
    momentum_masking: bool = False
    """Zero the optimizer's momentum where a message moved an element (DGC's factor masking).
    Off in both presets."""
    gradients_at: str | None = None
    """``"local"`` (dgc: forward and backward at the shared parameters plus this replica's
    unsent updates, CSER's error reset) or ``"shared"`` (dl4j: at the shared parameters)."""
    encoding: str = "auto"
    """``"auto"`` chooses by density between the preset's sparse format (dgc: gap16, dl4j:
    threshold) and the bitmap; ``"threshold"``, ``"gap16"`` or ``"bitmap"`` forces one."""
    broadcast_buffers: bool = True
    """Copy rank 0's buffers (BatchNorm statistics) after each step, those some replica
    changed."""
    overlap: bool | None = None
    """Run each step's exchange while the next step computes (peers' updates arrive one step
    later). Needs ``gradients_at="local"`` and messages of one size (an exact-count threshold
    algorithm, or bitmaps). None: on in dgc wherever it can run, off otherwise."""

    def __post_init__(self) -> None:
        if self.preset not in _PRESETS:
            raise ValueError(f"recipe (preset) {self.preset!r}; expected 'dgc' (top-k sharing with "
                             f"gradients at the local view, trains at the dense recipe) or "
                             f"'dl4j' (DL4J's exact rules)")
        preset = _PRESETS[self.preset]
        algorithm = self.threshold_algorithm
        if algorithm is None:
            algorithm = preset.threshold_algorithm()
        if not isinstance(algorithm, ThresholdAlgorithm):
            raise TypeError(f"threshold_algorithm={algorithm!r}; expected a "
                            f"ThresholdAlgorithm such as QuantileThreshold(1/300), "
                            f"FixedThreshold(1e-3) or AdaptiveThreshold(initial=1e-3)")
        post = self.residual_post_processor
        if post is None:
            post = copy.copy(preset.residual_post_processor)
        if post is not None and not isinstance(post, ResidualPostProcessor):
            raise TypeError(f"residual_post_processor={post!r}; expected None or a "
                            f"ResidualPostProcessor such as ResidualClipping(5.0, 5)")
        combine = preset.combine if self.combine is None else self.combine
        if combine not in _COMBINES:
            raise ValueError(f"combine={combine!r}; expected 'mean' (average the replicas' "
                             f"updates, like all-reduce) or 'sum' (DL4J's rule)")
        if self.encoding not in ENCODINGS:
            raise ValueError(f"encoding={self.encoding!r}; expected one of {ENCODINGS}")
        gradients_at = preset.gradients_at if self.gradients_at is None else self.gradients_at
        if gradients_at not in _GRADIENTS_AT:
            raise ValueError(f"gradients_at={gradients_at!r}; expected 'local' (forward and "
                             f"backward on the shared parameters plus this replica's unsent "
                             f"updates) or 'shared' (on the shared parameters, DL4J's rule)")
        for name in ("momentum_masking", "broadcast_buffers", "overlap"):
            value = getattr(self, name)  # bool("no") is True: a string must not turn one on
            if not isinstance(value, bool) and value is not None:
                raise TypeError(f"{name}={value!r}; expected True or False (or None: the "
                                "preset's choice)")
        for name, value in (("threshold_algorithm", algorithm),
                            ("residual_post_processor", post), ("combine", combine),
                            ("gradients_at", gradients_at),
                            ("momentum_masking", bool(self.momentum_masking)),
                            ("broadcast_buffers", self.broadcast_buffers is not False)):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "overlap", self._resolve_overlap())

    def _resolve_overlap(self) -> bool:
        """As asked; else on in the dgc preset wherever it can run (at the local view, with
        messages of one size: a ``capacity``)."""
        if self.overlap is None:
            return self.preset == "dgc" and self.gradients_at == "local" \
                and self.capacity(1 << 20) is not None
        if self.overlap and self.gradients_at != "local":
            raise ValueError("overlap=True with gradients_at='shared'; expected "
                             "gradients_at='local': a replica's own message must stay in its "
                             "local view while the exchange runs (with gradients at the shared "
                             "parameters, an exchange one step behind diverged at lr 0.1)")
        if self.overlap:
            object.__setattr__(self, "overlap", True)
            self.check_overlap(1 << 20)  # refused when built, not in the workers
        return bool(self.overlap)

    @classmethod
    def given(cls, recipe: str | SharingRecipe, options: dict[str, Any]) -> SharingRecipe:
        """The recipe a synchronizer was given: a SharingRecipe as it is, or a preset's name
        with ``options`` set (None means the preset's value). Options beside a SharingRecipe
        are refused (``TypeError``): they belong inside it."""
        if not isinstance(recipe, SharingRecipe):
            return cls(recipe, **options)
        defaults = {"encoding": "auto", "broadcast_buffers": True}
        given = sorted(name for name, value in options.items()
                       if value is not None and value != defaults.get(name))
        if given:
            raise TypeError(f"options {given} were given beside recipe=SharingRecipe(...); "
                            f"expected them inside it: SharingRecipe({given[0]}=...)")
        return recipe

    # -- what the options imply ----------------------------------------------------------------
    def new_threshold_algorithm(self) -> ThresholdAlgorithm:
        """A copy of the threshold algorithm for one synchronizer to step: the recipe stays a
        value that several wrappers may share."""
        return copy.deepcopy(self._algorithm())

    def forced_format(self) -> Format | None:
        """The format ``encoding`` forces, or None for "auto"."""
        return _FORCED.get(self.encoding)

    def sparse_format(self) -> Format:
        """The format of sparse messages: the forced one, else the preset's."""
        if self.encoding in ("threshold", "gap16"):
            return _FORCED[self.encoding]
        return _PRESETS[self.preset].sparse_format

    def capacity(self, numel: int) -> int | None:
        """Payload words that no message exceeds, when messages have one size (bitmaps, or
        a threshold algorithm that fixes the count: ``message_count``): the exchange then
        takes one collective. None otherwise."""
        bitmap_words = -(-numel // 16)
        if self.encoding == "bitmap":
            return bitmap_words
        count = self._algorithm().message_count(numel)
        if count is None:
            return None
        words = -(-count // 2) if self.sparse_format() == Format.GAP16 else count
        # Below half the bitmap's words a message is never a bitmap, and from the bitmap's
        # words on always one (see choose_format); between, either, and the bitmap is larger.
        return words if 2 * words < bitmap_words else bitmap_words

    def check_overlap(self, numel: int) -> None:
        """``ValueError`` if ``overlap`` is on but messages for ``numel`` elements would not
        have one size, which an exchange started ahead needs."""
        if self.overlap and self.capacity(numel) is None:
            raise ValueError(f"shared_gradients: overlap=True with {self._algorithm()!r} and "
                             f"encoding={self.encoding!r}; expected messages of one size, "
                             "which an exchange started ahead needs: QuantileThreshold("
                             "density, exact_count=True), or encoding='bitmap'")

    def update_scale(self, world_size: int) -> float:
        """The factor on each update added to the residual (``1 / world_size`` when the
        updates are averaged)."""
        return 1.0 / world_size if self.combine == "mean" else 1.0

    def config(self) -> dict[str, Any]:
        """The options as JSON (a checkpoint must match them to resume)."""
        post = self.residual_post_processor
        return {"threshold_algorithm": self._algorithm().config(),
                "residual_post_processor": None if post is None else post.config(),
                "recipe": self.preset, "combine": self.combine,
                "momentum_masking": self.momentum_masking, "gradients_at": self.gradients_at,
                "encoding": self.encoding,
                "broadcast_buffers": self.broadcast_buffers, "overlap": self.overlap}

    def _algorithm(self) -> ThresholdAlgorithm:
        algorithm = self.threshold_algorithm
        if algorithm is None:  # never: __post_init__ resolved it
            raise RuntimeError("SharingRecipe was built without resolving its threshold")
        return algorithm


class RecipeOptions:
    """A synchronizer's recipe options as read-only attributes (``SharedGradients`` has them)."""

    recipe: SharingRecipe

    @property
    def combine(self) -> str:
        """The recipe's ``combine``: "mean" (each update counts 1/workers) or "sum"."""
        return str(self.recipe.combine)

    @property
    def momentum_masking(self) -> bool:
        """Whether the optimizer's momentum is zeroed where a message moved an element."""
        return self.recipe.momentum_masking

    @property
    def gradients_at(self) -> str:
        """The recipe's ``gradients_at``: "local" (at the local view) or "shared"."""
        return str(self.recipe.gradients_at)

    @property
    def encoding(self) -> str:
        """The recipe's message encoding: "auto", "threshold", "gap16" or "bitmap"."""
        return self.recipe.encoding

    @property
    def broadcast_buffers(self) -> bool:
        """Whether buffers a forward wrote (BatchNorm statistics) are broadcast from rank 0."""
        return self.recipe.broadcast_buffers

    @property
    def overlap(self) -> bool:
        """Whether each step's exchange runs while the next step computes."""
        return bool(self.recipe.overlap)
