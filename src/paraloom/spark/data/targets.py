"""A scalar label column against a one-unit output: the targets take the output's shape."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from paraloom.forward import LossFn

__all__ = ["ColumnTargets", "column_loss"]

_ELEMENTWISE = (nn.MSELoss, nn.L1Loss, nn.SmoothL1Loss, nn.HuberLoss, nn.BCELoss,
                nn.BCEWithLogitsLoss)
"""PyTorch's losses that compare outputs and targets element by element: given (n, 1) outputs
and (n,) targets, MSE and L1 broadcast them to (n, n) (with a warning that Spark's executors
keep to themselves), BCE refuses them."""


class ColumnTargets:
    """``loss(outputs, targets)``, with (n,) targets made (n, 1) when the output is (n, 1),
    and integer targets (0/1 class labels) given the output's dtype, which these losses need.

    A DataFrame's scalar label column arrives as one value per row; a regression model's
    output has one unit per row. Keras lines the two up the same way.
    """

    def __init__(self, loss: nn.Module) -> None:
        self.loss = loss

    def __call__(self, outputs: Any, targets: Any) -> Any:
        if isinstance(outputs, Tensor) and isinstance(targets, Tensor):
            if outputs.dim() == 2 and outputs.shape[1] == 1 \
                    and targets.shape == outputs.shape[:1]:
                targets = targets.unsqueeze(1)
            if outputs.is_floating_point() and not targets.is_floating_point():
                targets = targets.to(outputs.dtype)  # 0/1 class labels for BCE, as Keras takes
        return self.loss(outputs, targets)

    @property
    def reduction(self) -> str:
        """The wrapped loss's ``reduction``, which ``forward.batch_total`` reads to total a
        batch (a "sum" loss taken for a mean was counted once per row again)."""
        return str(getattr(self.loss, "reduction", "mean"))

    def __repr__(self) -> str:
        return f"ColumnTargets({self.loss!r})"


def column_loss(loss_fn: LossFn | None) -> LossFn | None:
    """``loss_fn`` with ``ColumnTargets`` around each of PyTorch's elementwise losses in it
    (one loss, or one per output)."""
    if loss_fn is None:
        return None
    if callable(loss_fn):
        return _column_one(loss_fn)
    return [_column_one(f) for f in loss_fn]


def _column_one(loss: Callable[[Any, Any], Tensor]) -> Callable[[Any, Any], Tensor]:
    return ColumnTargets(loss) if isinstance(loss, _ELEMENTWISE) else loss
