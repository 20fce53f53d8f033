"""Distributed evaluation and inference: the model travels once per job, cached per worker.

The driver broadcasts the model (cloudpickled structure) and its parameters (safetensors
bytes); each Python worker builds it once per parameter version and keeps it in the
``runtime.executor.cached`` LRU, as ``predict_batch_udf`` does. Evaluation merges
per-partition metric states with ``treeAggregate``; DataFrames are scored by an iterator
pandas UDF (Arrow batches), RDDs by ``mapPartitions``.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import (  # noqa: UP035 (pandas_udf reads these type hints)
    TYPE_CHECKING,
    Any,
    Iterator,
    Literal,
    Tuple,
    TypeVar,
    overload,
)

import cloudpickle
import numpy as np
import pandas as pd
import torch
from torch import nn

from paraloom.evaluation import Evaluation
from paraloom.forward import LossFn, compute_loss, forward
from paraloom.spark.data import Features, Pair, partition_arrays, to_array
from paraloom.spark.evaluation.metrics import MetricState, RegressionEvaluation, merge_evaluations
from paraloom.spark.runtime import cached, pack, task_threads, unpack

if TYPE_CHECKING:
    from pyspark import RDD, Broadcast, SparkContext
    from pyspark.sql import DataFrame

__all__ = ["Shipment", "ship", "shipped_model", "evaluate_rdd", "predict_rdd",
           "predict_dataframe"]

T = TypeVar("T")
S = TypeVar("S", bound=MetricState)
_Scorer = Callable[[Iterator[pd.Series]], Iterator[pd.Series]]
_ColumnsScorer = Callable[[Iterator[Tuple[pd.Series, ...]]], Iterator[pd.Series]]  # noqa: UP006


@dataclass(frozen=True)
class Shipment:
    """Broadcast handles for one model version, and how to turn rows into its inputs."""

    key: str
    model: Broadcast[bytes]
    """The cloudpickled module."""
    state: Broadcast[bytes]
    """Its parameters, ``pack``ed."""
    features: Features


def ship(sc: SparkContext, model: nn.Module, features: Features) -> Shipment:
    """Broadcast ``model`` (structure and current parameters) for evaluation or inference."""
    state = pack({k: v for k, v in model.state_dict().items()})
    key = hashlib.sha256(state).hexdigest()[:24]
    return Shipment(key, sc.broadcast(cloudpickle.dumps(model)), sc.broadcast(state), features)


def shipped_model(shipment: Shipment) -> nn.Module:
    """The shipment's model in this Python worker, in eval mode (built once, then cached)."""
    def build() -> nn.Module:
        model: nn.Module = cloudpickle.loads(shipment.model.value)
        model.load_state_dict(unpack(shipment.state.value).model)
        return model.eval()

    return cached(f"model/{shipment.key}", build)


@torch.no_grad()
def _outputs(model: nn.Module, x: np.ndarray, features: Features, batch_size: int) -> torch.Tensor:
    inputs = features.features(x)
    return torch.cat([forward(model, inputs[i:i + batch_size])
                      for i in range(0, len(inputs), batch_size)])


def _chunks(rows: Iterable[T], size: int) -> Iterator[list[T]]:
    it = iter(rows)
    while chunk := list(itertools.islice(it, size)):
        yield chunk


def _classification(out: torch.Tensor) -> Evaluation:
    return Evaluation(int(out.shape[1]))


def _regression(out: torch.Tensor) -> RegressionEvaluation:
    return RegressionEvaluation(out[0].numel())


def _evaluate_partition(shipment: Shipment, loss_fn: LossFn | None, batch_size: int,
                        new_state: Callable[[torch.Tensor], S],
                        rows: Iterable[Pair]) -> Iterator[S | None]:
    task_threads()
    model = shipped_model(shipment)
    state: S | None = None
    for chunk in _chunks(rows, batch_size):
        x, y = partition_arrays(chunk)
        with torch.no_grad():
            out = forward(model, shipment.features.features(x))
            targets = shipment.features.labels(y)
            loss = float(compute_loss(loss_fn, out, targets)) * len(targets) \
                if loss_fn is not None else 0.0
        if state is None:
            state = new_state(out)
        state.update(out, targets, loss)
    yield state


def _aggregate(rows: RDD[Pair], shipment: Shipment, loss_fn: LossFn | None, batch_size: int,
               new_state: Callable[[torch.Tensor], S], depth: int) -> S:
    def run(part: Iterable[Pair]) -> Iterator[S | None]:
        return _evaluate_partition(shipment, loss_fn, batch_size, new_state, part)

    zero: S | None = None
    result = rows.mapPartitions(run).treeAggregate(zero, merge_evaluations, merge_evaluations,
                                                   depth=depth)
    if result is None:
        raise ValueError("evaluate() got no rows: the data is empty")
    return result


@overload
def evaluate_rdd(rows: RDD[Pair], shipment: Shipment, *, loss_fn: LossFn | None = None,
                 batch_size: int = 256, regression: Literal[False] = False,
                 depth: int = 2) -> Evaluation: ...
@overload
def evaluate_rdd(rows: RDD[Pair], shipment: Shipment, *, loss_fn: LossFn | None = None,
                 batch_size: int = 256, regression: Literal[True],
                 depth: int = 2) -> RegressionEvaluation: ...
def evaluate_rdd(rows: RDD[Pair], shipment: Shipment, *, loss_fn: LossFn | None = None,
                 batch_size: int = 256, regression: bool = False,
                 depth: int = 2) -> Evaluation | RegressionEvaluation:
    """Evaluation (or RegressionEvaluation) of ``(features, label)`` rows via treeAggregate."""
    if regression:
        return _aggregate(rows, shipment, loss_fn, batch_size, _regression, depth)
    return _aggregate(rows, shipment, loss_fn, batch_size, _classification, depth)


def _per_row(out: torch.Tensor, argmax: bool) -> list[Any]:
    if argmax:
        return out.argmax(dim=1).tolist()
    return list(out.reshape(len(out), -1).cpu().numpy())


def predict_rdd(rdd: RDD[Any], shipment: Shipment, *, batch_size: int = 256,
                argmax: bool = False, keyed: bool = False) -> RDD[Any]:
    """Outputs for an RDD of features (same order), or of ``(key, features)`` pairs."""
    def run(rows: Iterable[Any]) -> Iterator[Any]:
        task_threads()
        model = shipped_model(shipment)
        for chunk in _chunks(rows, batch_size):
            keys = [k for k, _ in chunk] if keyed else None
            x = np.stack([to_array(f) for f in ([f for _, f in chunk] if keyed else chunk)])
            out = _per_row(_outputs(model, x, shipment.features, batch_size), argmax)
            yield from (zip(keys, out, strict=True) if keys is not None else out)

    return rdd.mapPartitions(run)


def _udf(shipment: Shipment, batch_size: int, argmax: bool,
         columns: int) -> _Scorer | _ColumnsScorer:
    def score(x: np.ndarray) -> pd.Series:
        model = shipped_model(shipment)
        if not len(x):
            return pd.Series([], dtype="int64" if argmax else "object")
        return pd.Series(_per_row(_outputs(model, x, shipment.features, batch_size), argmax))

    def one(batches: Iterator[pd.Series]) -> Iterator[pd.Series]:
        task_threads()
        for series in batches:
            yield score(np.stack([to_array(v) for v in series]) if len(series)
                        else np.zeros((0,), np.float32))

    def many(batches: Iterator[Tuple[pd.Series, ...]]) -> Iterator[pd.Series]:  # noqa: UP006
        task_threads()
        for cols in batches:
            yield score(np.column_stack([c.to_numpy() for c in cols]))

    return one if columns == 1 else many


def predict_dataframe(df: DataFrame, shipment: Shipment, *, features: str | list[str],
                      output: str = "prediction", batch_size: int = 256,
                      argmax: bool = False) -> DataFrame:
    """``df`` with a column ``output``: the model's output per row (flattened), or its argmax."""
    from pyspark.ml.functions import vector_to_array
    from pyspark.sql.functions import col, pandas_udf
    from pyspark.sql.types import ArrayType, DoubleType, FloatType, LongType

    names = [features] if isinstance(features, str) else list(features)
    missing = [n for n in names if n not in df.columns]
    if missing:
        raise ValueError(f"the DataFrame has no column(s) {missing}; its columns are "
                         f"{df.columns}. Pass features= the input column name(s)")
    cols = []
    for name in names:
        kind = type(df.schema[name].dataType).__name__
        cols.append(vector_to_array(col(name)) if kind == "VectorUDT" else col(name))
    element = DoubleType() if shipment.features.dtype == "float64" else FloatType()
    return_type = LongType() if argmax else ArrayType(element)
    udf = pandas_udf(_udf(shipment, batch_size, argmax, len(names)),  # type: ignore[call-overload]
                     return_type)
    return df.withColumn(output, udf(*cols))
