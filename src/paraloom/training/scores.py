"""Score calculators for early stopping: each declares whether higher is better."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from paraloom.data import iter_tensors, split_batch, to_device
from paraloom.evaluation import evaluate, evaluate_regression
from paraloom.forward import LossFn, batch_total, compute_loss, forward

__all__ = ["ScoreCalculator", "LossCalculator", "AccuracyCalculator", "F1Calculator",
           "MSECalculator", "CallableCalculator", "as_score_calculator"]


class ScoreCalculator:
    """Scores a model; ``higher_is_better`` says which way is up."""

    higher_is_better = False

    def score(self, model: nn.Module) -> float:
        raise NotImplementedError

    def better(self, a: float, b: float) -> bool:
        """True if score ``a`` beats score ``b``."""
        return a > b if self.higher_is_better else a < b


def _device(model: nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


class LossCalculator(ScoreCalculator):
    """Mean loss per example on a data set (lower is better), whatever the batch sizes and
    the loss's reduction (a ``reduction="sum"`` loss is divided by the rows, not multiplied)."""

    def __init__(self, data: Iterable[Any], loss_fn: LossFn) -> None:
        from paraloom.training.step_checks import require_loss

        require_loss(loss_fn, None)  # a string or a class fails here, naming the fix
        self.data, self.loss_fn = data, loss_fn

    @torch.no_grad()
    def score(self, model: nn.Module) -> float:
        was = model.training
        model.eval()
        total, count = 0.0, 0
        try:
            for batch in self.data:
                inputs, targets = to_device(split_batch(batch), _device(model))
                n = _rows(targets)
                total += float(compute_loss(batch_total(self.loss_fn, n), forward(model, inputs),
                                            targets))
                count += n
        finally:
            model.train(was)
        return total / max(1, count)


def _rows(targets: object) -> int:
    """A batch's rows: its targets' first dimension (the first target's, for several)."""
    first = next(iter_tensors(targets), None)
    return int(first.shape[0]) if first is not None and first.dim() else 1


class AccuracyCalculator(ScoreCalculator):
    """Classification accuracy on a data set (higher is better). ``threshold``: where one
    score per row turns class 1 (0 for a logit; 0.5 for a sigmoid's probability)."""

    higher_is_better = True

    def __init__(self, data: Iterable[Any], threshold: float = 0.0) -> None:
        self.data, self.threshold = data, threshold

    def score(self, model: nn.Module) -> float:
        return evaluate(model, self.data, threshold=self.threshold).accuracy


class F1Calculator(AccuracyCalculator):
    """Macro-averaged F1 on a data set (higher is better)."""

    def score(self, model: nn.Module) -> float:
        return float(evaluate(model, self.data, threshold=self.threshold).metrics()["f1"])


class MSECalculator(ScoreCalculator):
    """Regression mean squared error per target value (lower is better), as
    ``evaluate_regression`` computes it (targets shaped as the outputs)."""

    def __init__(self, data: Iterable[Any]) -> None:
        self.data = data

    def score(self, model: nn.Module) -> float:
        return float(evaluate_regression(model, self.data).metrics()["mse"])


class CallableCalculator(ScoreCalculator):
    """Any ``fn(model) -> float``."""

    def __init__(self, fn: Callable[[nn.Module], float], higher_is_better: bool = False) -> None:
        self.fn, self.higher_is_better = fn, higher_is_better

    def score(self, model: nn.Module) -> float:
        return float(self.fn(model))


def as_score_calculator(obj: object) -> ScoreCalculator:
    """A ScoreCalculator, or a callable (lower is better unless it has higher_is_better=True)."""
    if isinstance(obj, ScoreCalculator):
        return obj
    if callable(obj):
        return CallableCalculator(obj, bool(getattr(obj, "higher_is_better", False)))
    raise TypeError(f"score_calculator must be a ScoreCalculator or a callable model -> float; "
                    f"got {type(obj).__name__}")
