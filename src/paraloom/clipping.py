"""Gradient clipping between backward and the optimizer step, by Lightning's names.

``gradient_clip_val`` with ``gradient_clip_algorithm="norm"`` scales the gradients so that
their global 2-norm is at most the value (``torch.nn.utils.clip_grad_norm_``); ``"value"``
clamps each element to ``[-value, value]`` (``clip_grad_value_``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["CLIP_ALGORITHMS", "GradientClipping"]

CLIP_ALGORITHMS = ("norm", "value")


@dataclass(frozen=True)
class GradientClipping:
    """Clip to ``value`` by global ``"norm"`` or per element (``"value"``)."""

    value: float
    algorithm: str = "norm"

    def __post_init__(self) -> None:
        value = self.value
        if isinstance(value, bool) or not isinstance(value, int | float) \
                or not math.isfinite(value) or value <= 0:
            raise ValueError(f"gradient_clip_val={value!r}; expected a number > 0 (e.g. 1.0), "
                             f"or None not to clip")
        _check_algorithm(self.algorithm)

    @classmethod
    def of(cls, value: float | None, algorithm: str = "norm") -> GradientClipping | None:
        """The clipping that ``gradient_clip_val`` / ``gradient_clip_algorithm`` ask for
        (None: no clipping; the algorithm is still checked)."""
        if value is None:
            _check_algorithm(algorithm)
            return None
        return cls(value, algorithm)

    def clip_(self, optimizer: torch.optim.Optimizer) -> None:
        """Clip the gradients of the optimizer's parameters in place."""
        params: list[nn.Parameter] = [p for group in optimizer.param_groups
                                      for p in group["params"] if p.grad is not None]
        if not params:
            return
        if self.algorithm == "norm":
            nn.utils.clip_grad_norm_(params, self.value)
        else:
            nn.utils.clip_grad_value_(params, self.value)


def _check_algorithm(algorithm: str) -> None:
    if algorithm not in CLIP_ALGORITHMS:
        raise ValueError(f"gradient_clip_algorithm={algorithm!r}; expected one of "
                         f"{list(CLIP_ALGORITHMS)}")
