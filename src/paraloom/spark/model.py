"""SparkModel: fit, evaluate and predict a PyTorch model on Spark (DL4J's SparkDl4jMultiLayer)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, cast, overload

import torch
from torch import nn

from paraloom.data import cpu_copy
from paraloom.evaluation import Evaluation
from paraloom.forward import LossFn
from paraloom.spark.data import Features, as_rows, is_dataframe, is_rdd
from paraloom.spark.evaluation import (
    RegressionEvaluation,
    evaluate_rdd,
    predict_dataframe,
    predict_rdd,
    ship,
)
from paraloom.spark.runtime.interpreter import use_driver_python
from paraloom.spark.stats import TrainingStats
from paraloom.spark.training import FitJob, TrainingMaster
from paraloom.sync.base import NoSync
from paraloom.training.optim import OptimizerFactory, OptimizerSpec
from paraloom.training.replica import StepFn
from paraloom.training.runner import WorkerSpec

if TYPE_CHECKING:
    from pyspark import RDD, SparkContext
    from pyspark.sql import DataFrame, SparkSession

__all__ = ["SparkModel"]

log = logging.getLogger("paraloom")



def _spark_context(spark: SparkSession | SparkContext) -> SparkContext:
    sc = getattr(spark, "sparkContext", spark)
    if not hasattr(sc, "broadcast") or not hasattr(sc, "parallelize"):
        raise TypeError(f"spark must be a SparkSession or SparkContext; got "
                        f"{type(spark).__name__}. Spark Connect sessions have no RDD API: use "
                        f"a classic session (SparkSession.builder.master(...))")
    use_driver_python(sc)
    return cast("SparkContext", sc)


def _dtype_name(model: nn.Module) -> str:
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return str(dtype).removeprefix("torch.")


class SparkModel:
    """Train ``model`` on a Spark cluster with ``master``; the model then holds the result.

    ``data`` for ``fit`` / ``evaluate`` is an RDD of ``(features, label)`` pairs or a DataFrame
    with ``features=`` (one array/vector column, or a list of numeric columns) and ``label=``
    columns. ``feature_shape`` reshapes each row's features for the model (e.g. ``(1, 8, 8)``
    for flat 64-value rows); ``label_dtype`` forces the label dtype (e.g. ``torch.long`` for a
    DataFrame's double labels with a classification loss).
    """

    def __init__(self, spark: SparkSession | SparkContext, model: nn.Module,
                 master: TrainingMaster, *, loss_fn: LossFn | None = None,
                 optimizer: torch.optim.Optimizer | OptimizerFactory | None = None,
                 step_fn: StepFn | None = None,
                 feature_shape: Sequence[int] | None = None,
                 label_dtype: torch.dtype | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
        if not isinstance(master, TrainingMaster):
            raise TypeError(f"master must be a SharedTrainingMaster or a "
                            f"ParameterAveragingTrainingMaster; got {type(master).__name__}")
        self.sc = _spark_context(spark)
        self.model = model
        self.master = master
        self.loss_fn = loss_fn
        self.step_fn = step_fn
        self._user_optimizer = optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
        self._optimizer_spec = OptimizerSpec.from_user(optimizer, model) \
            if optimizer is not None else None
        self._optimizer_state: dict[str, Any] | None = None
        label = None if label_dtype is None else str(label_dtype).removeprefix("torch.")
        self.features = Features(tuple(feature_shape) if feature_shape else None,
                                 _dtype_name(model), label)
        self._stats: TrainingStats | None = None
        self._last_fit: dict[str, Any] = {}

    # -- training ------------------------------------------------------------------------------
    def _optimizer_state_now(self) -> dict[str, Any] | None:
        if self._user_optimizer is not None:
            return self._user_optimizer.state_dict() if self._user_optimizer.state else None
        return self._optimizer_state

    def fit(self, data: RDD[Any] | DataFrame, epochs: int = 1, *,
            features: str | Sequence[str] = "features", label: str = "label",
            collect_stats: bool = False, seed: int = 0) -> dict[str, Any]:
        """Train ``epochs`` passes over ``data``; returns a summary (samples/s, losses, bytes).

        With ``collect_stats=True`` per-worker, per-phase timings are kept: see
        ``training_stats()``.
        """
        if self._optimizer_spec is None:
            raise ValueError("fit() needs an optimizer: SparkModel(..., optimizer=torch.optim."
                             "SGD(model.parameters(), lr=0.05)) or a factory params -> Optimizer")
        if self.loss_fn is None and self.step_fn is None:
            raise ValueError("fit() needs loss_fn= (e.g. nn.CrossEntropyLoss()) or step_fn=")
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
            raise ValueError(f"epochs={epochs!r}; expected an int >= 1")
        spec = WorkerSpec(model=self.model, optimizer=self._optimizer_spec, loss_fn=self.loss_fn,
                          step_fn=self.step_fn, synchronizer=NoSync())
        state = cpu_copy(self.model.state_dict())
        job = FitJob(self.sc, spec, state, self._optimizer_state_now(), self.features)
        result = self.master.fit(job, as_rows(data, features, label), epochs=epochs, seed=seed,
                                 collect_stats=collect_stats)
        with torch.no_grad():
            self.model.load_state_dict(result.state)
        self._adopt_optimizer(result.optimizer_state)
        self._stats = result.stats
        self._last_fit = result.summary
        return dict(result.summary)

    def _adopt_optimizer(self, state: dict[str, Any] | None) -> None:
        if state is None:
            return
        self._optimizer_state = state
        if self._user_optimizer is not None:
            try:
                self._user_optimizer.load_state_dict(state)
            except (ValueError, KeyError) as e:  # a factory-built optimizer may differ in shape
                log.debug("optimizer state not copied back: %s", e)

    def training_stats(self) -> TrainingStats | None:
        """Timings of the last ``fit(collect_stats=True)``; None if it did not collect them."""
        return self._stats

    # -- evaluation and inference --------------------------------------------------------------
    def evaluate(self, data: RDD[Any] | DataFrame, *, features: str | Sequence[str] = "features",
                 label: str = "label", batch_size: int = 256) -> Evaluation:
        """Classification metrics (accuracy, precision, recall, F1, confusion matrix, loss)."""
        return self._evaluate(data, features, label, batch_size, regression=False)

    def evaluate_regression(self, data: RDD[Any] | DataFrame, *,
                            features: str | Sequence[str] = "features", label: str = "label",
                            batch_size: int = 256) -> RegressionEvaluation:
        """Regression metrics (MSE, MAE, RMSE, R² per output column, and their means)."""
        return self._evaluate(data, features, label, batch_size, regression=True)

    @overload
    def _evaluate(self, data: RDD[Any] | DataFrame, features: str | Sequence[str], label: str,
                  batch_size: int, regression: Literal[False]) -> Evaluation: ...
    @overload
    def _evaluate(self, data: RDD[Any] | DataFrame, features: str | Sequence[str], label: str,
                  batch_size: int, regression: Literal[True]) -> RegressionEvaluation: ...
    def _evaluate(self, data: RDD[Any] | DataFrame, features: str | Sequence[str], label: str,
                  batch_size: int, regression: bool) -> Evaluation | RegressionEvaluation:
        rows = as_rows(data, features, label)
        shipment = ship(self.sc, self.model, self.features)
        try:
            if regression:
                return evaluate_rdd(rows, shipment, loss_fn=self.loss_fn, batch_size=batch_size,
                                    regression=True)
            return evaluate_rdd(rows, shipment, loss_fn=self.loss_fn, batch_size=batch_size)
        finally:
            shipment.model.unpersist()
            shipment.state.unpersist()

    @overload
    def predict(self, data: DataFrame, *, features: str | Sequence[str] = ...,
                output: str = ..., batch_size: int = ..., argmax: bool = ...,
                keyed: bool = ...) -> DataFrame: ...
    @overload
    def predict(self, data: RDD[Any], *, features: str | Sequence[str] = ...,
                output: str = ..., batch_size: int = ..., argmax: bool = ...,
                keyed: bool = ...) -> RDD[Any]: ...
    def predict(self, data: RDD[Any] | DataFrame, *, features: str | Sequence[str] = "features",
                output: str = "prediction", batch_size: int = 256, argmax: bool = False,
                keyed: bool = False) -> DataFrame | RDD[Any]:
        """The model's outputs: a DataFrame with an ``output`` column, or an RDD of outputs.

        A DataFrame gets one ``array<float>`` per row (the row's output, flattened), or with
        ``argmax=True`` the class index as a long. An RDD of features gives one numpy array (or
        class index) per element, in order; with ``keyed=True`` it holds ``(key, features)``
        pairs and gives ``(key, output)`` pairs (DL4J's feedForwardWithKey).
        """
        shipment = ship(self.sc, self.model, self.features)
        if is_dataframe(data):
            cols = features if isinstance(features, str) else list(features)
            return predict_dataframe(data, shipment, features=cols, output=output,
                                     batch_size=batch_size, argmax=argmax)
        if is_rdd(data):
            return predict_rdd(data, shipment, batch_size=batch_size, argmax=argmax, keyed=keyed)
        raise TypeError(f"data must be a pyspark DataFrame or RDD; got {type(data).__name__}")

    def __repr__(self) -> str:
        return f"SparkModel({type(self.model).__name__}, {self.master!r})"
