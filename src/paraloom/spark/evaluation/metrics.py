"""Regression metrics with a mergeable state (DL4J's RegressionEvaluation), for treeAggregate."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:  # typing has Self from Python 3.11 on
    from typing_extensions import Self

import numpy as np
import torch

__all__ = ["MetricState", "RegressionEvaluation", "merge_evaluations"]


class MetricState(Protocol):
    """What partitions count and treeAggregate merges: Evaluation, RegressionEvaluation."""

    def update(self, outputs: torch.Tensor, targets: torch.Tensor, loss_sum: float = 0.0,
               /) -> None: ...

    def merge(self, other: Self, /) -> Self: ...


M = TypeVar("M", bound=MetricState)


@dataclass
class RegressionEvaluation:
    """Per-column sums from which MSE, MAE, RMSE and R² follow; ``merge`` adds two states."""

    columns: int
    count: int = 0
    loss_sum: float = 0.0
    sum_sq_error: np.ndarray = field(init=False)
    sum_abs_error: np.ndarray = field(init=False)
    sum_target: np.ndarray = field(init=False)
    sum_sq_target: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        if self.columns < 1:
            raise ValueError(f"columns={self.columns}; expected >= 1")
        for name in ("sum_sq_error", "sum_abs_error", "sum_target", "sum_sq_target"):
            setattr(self, name, np.zeros(self.columns, dtype=np.float64))

    @staticmethod
    def _as_2d(t: torch.Tensor, rows: int) -> np.ndarray:
        return t.detach().to("cpu", torch.float64).reshape(rows, -1).numpy()

    def update(self, outputs: torch.Tensor, targets: torch.Tensor, loss_sum: float = 0.0) -> None:
        """Count one batch of predictions against targets (same number of values per row)."""
        rows = int(targets.shape[0]) if targets.dim() else 1
        pred, true = self._as_2d(outputs, rows), self._as_2d(targets, rows)
        if pred.shape != true.shape or pred.shape[1] != self.columns:
            raise ValueError(f"outputs {tuple(outputs.shape)} and targets {tuple(targets.shape)} "
                             f"do not match {self.columns} column(s) per row")
        err = pred - true
        self.sum_sq_error += (err ** 2).sum(0)
        self.sum_abs_error += np.abs(err).sum(0)
        self.sum_target += true.sum(0)
        self.sum_sq_target += (true ** 2).sum(0)
        self.count += rows
        self.loss_sum += float(loss_sum)

    def merge(self, other: RegressionEvaluation) -> RegressionEvaluation:
        """The sum of two states (in place on self, returned for reduce / treeAggregate)."""
        if other.columns != self.columns:
            raise ValueError(f"cannot merge regression evaluations of {self.columns} and "
                             f"{other.columns} columns")
        for name in ("sum_sq_error", "sum_abs_error", "sum_target", "sum_sq_target"):
            getattr(self, name).__iadd__(getattr(other, name))
        self.count += other.count
        self.loss_sum += other.loss_sum
        return self

    def metrics(self) -> dict[str, Any]:
        """Mean over columns of MSE, MAE, RMSE and R², the per-column lists, mean loss, count."""
        n = max(1, self.count)
        mse = self.sum_sq_error / n
        mae = self.sum_abs_error / n
        variance = self.sum_sq_target / n - (self.sum_target / n) ** 2
        with np.errstate(divide="ignore", invalid="ignore"):
            r2 = np.where(variance > 0, 1 - mse / np.where(variance > 0, variance, 1), np.nan)
        return {"mse": float(mse.mean()), "mae": float(mae.mean()),
                "rmse": float(np.sqrt(mse).mean()), "r2": float(np.nanmean(r2))
                if np.isfinite(r2).any() else float("nan"),
                "loss": self.loss_sum / n, "count": self.count,
                "per_column": {"mse": mse.tolist(), "mae": mae.tolist(), "r2": r2.tolist()}}

    def report(self) -> str:
        """One printable line."""
        m = self.metrics()
        return (f"MSE {m['mse']:.6g}   MAE {m['mae']:.6g}   RMSE {m['rmse']:.6g}   "
                f"R² {m['r2']:.4f}   ({m['count']} examples, {self.columns} column(s))")


def merge_evaluations(a: M | None, b: M | None) -> M | None:
    """treeAggregate's combiner for Evaluation / RegressionEvaluation states (None: no rows)."""
    if a is None:
        return b
    if b is None:
        return a
    return a.merge(b)
