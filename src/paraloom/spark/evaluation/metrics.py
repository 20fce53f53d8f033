"""Mergeable metric states for treeAggregate: the protocol, several metrics in one pass.

The metrics themselves (Evaluation, RegressionEvaluation, ROC) live in ``paraloom.evaluation``:
one implementation for local and Spark evaluation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:  # typing has Self from Python 3.11 on
    from typing_extensions import Self

import torch

from paraloom.evaluation import ROC, Evaluation, RegressionEvaluation

__all__ = ["MetricState", "MetricSet", "METRICS", "RegressionEvaluation", "ROC",
           "merge_evaluations", "metric_factory", "StateBuilder"]


class MetricState(Protocol):
    """What partitions count and treeAggregate merges: Evaluation, RegressionEvaluation."""

    def update(self, outputs: torch.Tensor, targets: torch.Tensor, loss_sum: float = 0.0,
               /) -> None: ...

    def merge(self, other: Self, /) -> Self: ...


M = TypeVar("M", bound=MetricState)


METRICS = ("classification", "roc", "regression")
"""What ``evaluate(metrics=[...])`` computes: Evaluation, ROC, RegressionEvaluation."""


def _classes(out: torch.Tensor) -> int:
    """Classes a batch of outputs scores: one per column, 2 for one logit per row (binary)."""
    return int(out.shape[1]) if out.dim() > 1 and out.shape[1] > 1 else 2


StateBuilder = Callable[[torch.Tensor, float], M]
"""``build(outputs, threshold)``: a metric state sized from the first batch of the counted
output; ``threshold``: where one score per row of that output turns class 1
(``Evaluation.threshold``: 0.5 for an output trained with BCELoss, else 0)."""


def metric_factory(name: str) -> StateBuilder[MetricState]:
    """A state builder for one metric name."""
    if name == "classification":
        return lambda out, threshold: Evaluation(_classes(out), threshold=threshold)
    if name == "roc":
        return lambda out, threshold: ROC(_classes(out), probabilities=threshold == 0.5)
    if name == "regression":
        return lambda out, threshold: RegressionEvaluation(out[0].numel())
    raise ValueError(f"unknown metric {name!r}; expected some of {list(METRICS)}")


@dataclass
class MetricSet:
    """Several metric states updated from the same outputs: one pass for all of them."""

    states: dict[str, MetricState]

    @classmethod
    def factory(cls, names: Sequence[str]) -> StateBuilder[MetricSet]:
        """A builder of the named states (checked now, built on the first batch)."""
        if isinstance(names, str) or not names:
            raise ValueError(f"metrics={names!r}; expected a non-empty list of {list(METRICS)}")
        makers = {n: metric_factory(n) for n in names}
        return lambda out, threshold: cls({n: make(out, threshold) for n, make in makers.items()})

    def update(self, outputs: torch.Tensor, targets: torch.Tensor, loss_sum: float = 0.0) -> None:
        """Count one batch in every state."""
        for state in self.states.values():
            state.update(outputs, targets, loss_sum)

    def merge(self, other: MetricSet) -> MetricSet:
        """Every state merged with the other set's state of the same name."""
        for name, state in self.states.items():
            state.merge(other.states[name])
        return self


def merge_evaluations(a: M | None, b: M | None) -> M | None:
    """treeAggregate's combiner for Evaluation / RegressionEvaluation states (None: no rows)."""
    if a is None:
        return b
    if b is None:
        return a
    return a.merge(b)
