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
from collections.abc import Callable, Iterable, Sequence
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

from paraloom.data import batch_size as batch_size_of
from paraloom.data import map_tensors
from paraloom.evaluation import Evaluation
from paraloom.forward import LossFn, compute_loss, forward
from paraloom.spark.data import Features, Pair, partition_arrays, to_array
from paraloom.spark.data.arrays import stack
from paraloom.spark.data.rows import field
from paraloom.spark.evaluation.metrics import (
    MetricSet,
    MetricState,
    RegressionEvaluation,
    merge_evaluations,
)
from paraloom.spark.runtime import cached, pack, task_threads, unpack

if TYPE_CHECKING:
    from pyspark import RDD, Broadcast, SparkContext
    from pyspark.sql import DataFrame

__all__ = ["Shipment", "ship", "shipped_model", "evaluate_rdd", "evaluate_metrics", "predict_rdd",
           "predict_dataframe"]

T = TypeVar("T")
S = TypeVar("S", bound=MetricState)


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


def _cat(parts: list[Any]) -> Any:
    """Per-slice outputs joined row-wise: a tensor, or a tuple (or dict) of them."""
    first = parts[0]
    if isinstance(first, (tuple, list)):
        return tuple(torch.cat([p[i] for p in parts]) for i in range(len(first)))
    if isinstance(first, dict):
        return {k: torch.cat([p[k] for p in parts]) for k in first}
    return torch.cat(parts)


@torch.no_grad()
def _outputs(model: nn.Module, x: Any, features: Features, batch_size: int) -> Any:
    inputs = features.features(x)
    n = batch_size_of(inputs)
    def rows(start: int) -> Any:
        return map_tensors(inputs, lambda t: t[start:start + batch_size])

    return _cat([forward(model, rows(i)) for i in range(0, n, batch_size)])


def pick_output(out: Any, targets: Any, output: int | str | None) -> tuple[Any, Any]:
    """The one output (and target) a metric counts: ``output`` of several, else the only one."""
    several = isinstance(out, (tuple, list, dict))
    if output is None:
        if several:
            raise ValueError(f"the model returned {len(out)} outputs; evaluate one at a time "
                             f"with output=0 .. {len(out) - 1} (or its name for a dict)")
        return out, targets
    if not several:
        if output in (0, -1):
            return out, targets[output] if isinstance(targets, (tuple, list)) else targets
        raise ValueError(f"output={output!r} but the model returned one output; leave output "
                         f"unset")
    try:
        chosen = out[output]  # a name for a dict, an index otherwise
    except (IndexError, KeyError, TypeError):
        raise ValueError(f"output={output!r} but the model returned {len(out)} outputs") from None
    if isinstance(targets, (tuple, list, dict)):
        return chosen, targets[output]  # type: ignore[index]
    return chosen, targets


def _chunks(rows: Iterable[T], size: int) -> Iterator[list[T]]:
    it = iter(rows)
    while chunk := list(itertools.islice(it, size)):
        yield chunk


def _classification(out: torch.Tensor) -> Evaluation:
    return Evaluation(int(out.shape[1]))


def _regression(out: torch.Tensor) -> RegressionEvaluation:
    return RegressionEvaluation(out[0].numel())


def _evaluate_partition(shipment: Shipment, loss_fn: LossFn | None, batch_size: int,
                        new_state: Callable[[torch.Tensor], S], output: int | str | None,
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
        chosen, target = pick_output(out, targets, output)
        if state is None:
            state = new_state(chosen)
        state.update(chosen, target, loss)
    yield state


def _aggregate(rows: RDD[Pair], shipment: Shipment, loss_fn: LossFn | None, batch_size: int,
               new_state: Callable[[torch.Tensor], S], depth: int,
               output: int | str | None = None) -> S:
    def run(part: Iterable[Pair]) -> Iterator[S | None]:
        return _evaluate_partition(shipment, loss_fn, batch_size, new_state, output, part)

    zero: S | None = None
    result = rows.mapPartitions(run).treeAggregate(zero, merge_evaluations, merge_evaluations,
                                                   depth=depth)
    if result is None:
        raise ValueError("evaluate() got no rows: the data is empty")
    return result


@overload
def evaluate_rdd(rows: RDD[Pair], shipment: Shipment, *, loss_fn: LossFn | None = None,
                 batch_size: int = 256, regression: Literal[False] = False,
                 depth: int = 2, output: int | str | None = None) -> Evaluation: ...
@overload
def evaluate_rdd(rows: RDD[Pair], shipment: Shipment, *, loss_fn: LossFn | None = None,
                 batch_size: int = 256, regression: Literal[True],
                 depth: int = 2, output: int | str | None = None) -> RegressionEvaluation: ...
def evaluate_rdd(rows: RDD[Pair], shipment: Shipment, *, loss_fn: LossFn | None = None,
                 batch_size: int = 256, regression: bool = False,
                 depth: int = 2,
                 output: int | str | None = None) -> Evaluation | RegressionEvaluation:
    """Evaluation (or RegressionEvaluation) of ``(features, label)`` rows via treeAggregate.

    ``output`` picks which of a multi-output model's outputs (and targets) is counted.
    """
    if regression:
        return _aggregate(rows, shipment, loss_fn, batch_size, _regression, depth, output)
    return _aggregate(rows, shipment, loss_fn, batch_size, _classification, depth, output)


def evaluate_metrics(rows: RDD[Pair], shipment: Shipment, metrics: Sequence[str], *,
                     loss_fn: LossFn | None = None, batch_size: int = 256, depth: int = 2,
                     output: int | str | None = None) -> dict[str, Any]:
    """Several metrics (``metrics.METRICS`` names) of ``(features, label)`` rows, one pass."""
    result = _aggregate(rows, shipment, loss_fn, batch_size, MetricSet.factory(metrics), depth,
                        output)
    return dict(result.states)


def _per_row(out: torch.Tensor, argmax: bool) -> list[Any]:
    if argmax:
        if out.dim() < 2:
            raise ValueError(f"argmax=True needs outputs of shape (rows, classes); the model "
                             f"returned shape {tuple(out.shape)}. Leave argmax unset")
        return out.argmax(dim=1).tolist()
    return list(out.reshape(len(out), -1).cpu().numpy())


def _several(out: Any) -> list[torch.Tensor] | None:
    """A multi-output model's outputs in order (a dict's in its order); None for one tensor."""
    if isinstance(out, dict):
        return list(out.values())
    if isinstance(out, (tuple, list)):
        return list(out)
    return None


def predict_rdd(rdd: RDD[Any], shipment: Shipment, *, batch_size: int = 256,
                argmax: bool = False, keyed: bool = False) -> RDD[Any]:
    """Outputs for an RDD of features (same order), or of ``(key, features)`` pairs.

    Features that are a tuple (or dict) of arrays are several inputs; a model with several
    outputs gives a tuple per row.
    """
    def run(rows: Iterable[Any]) -> Iterator[Any]:
        task_threads()
        model = shipped_model(shipment)
        for chunk in _chunks(rows, batch_size):
            keys = [k for k, _ in chunk] if keyed else None
            x = stack([field(f) for f in ([f for _, f in chunk] if keyed else chunk)])
            out = _outputs(model, x, shipment.features, batch_size)
            parts = _several(out)
            per_row = (_per_row(out, argmax) if parts is None else
                       list(zip(*[_per_row(o, argmax) for o in parts], strict=True)))
            yield from (zip(keys, per_row, strict=True) if keys is not None else per_row)

    return rdd.mapPartitions(run)


def _assemble(cols: list[pd.Series], whole: bool) -> np.ndarray:
    """One input's rows from its columns: one column's values, or several assembled."""
    if whole:
        series = cols[0]
        return np.stack([to_array(v) for v in series]) if len(series) \
            else np.zeros((0,), np.float32)
    if all(pd.api.types.is_numeric_dtype(c.dtype) for c in cols):
        return np.column_stack([c.to_numpy() for c in cols])
    return np.stack([np.concatenate([np.ravel(to_array(c.iloc[i])) for c in cols])
                     for i in range(len(cols[0]))])


@dataclass(frozen=True)
class _Layout:
    """How the UDF's flat argument columns regroup into the model's inputs."""

    kind: str
    """"one" (features=), "tuple" (model(*inputs)) or "dict" (model(**inputs))."""
    names: tuple[str, ...]
    """Input names for "dict"."""
    spans: tuple[tuple[int, int, bool], ...]
    """Per input: (first column, column count, whole: a single column given by name)."""

    def inputs(self, cols: tuple[pd.Series, ...]) -> Any:
        arrays = [_assemble(list(cols[a:a + n]), whole) for a, n, whole in self.spans]
        if self.kind == "one":
            return arrays[0]
        if self.kind == "dict":
            return dict(zip(self.names, arrays, strict=True))
        return tuple(arrays)


def _layout(features: Any) -> tuple[_Layout, list[str]]:
    specs = (list(features.values()) if isinstance(features, dict)
             else list(features) if isinstance(features, tuple) else [features])
    spans: list[tuple[int, int, bool]] = []
    columns: list[str] = []
    for spec in specs:
        names = [spec] if isinstance(spec, str) else list(spec)
        spans.append((len(columns), len(names), isinstance(spec, str)))
        columns.extend(names)
    kind = "dict" if isinstance(features, dict) else "tuple" if isinstance(features, tuple) \
        else "one"
    keys = tuple(features) if isinstance(features, dict) else ()
    return _Layout(kind, keys, tuple(spans)), columns


def _udf(shipment: Shipment, batch_size: int, argmax: bool, layout: _Layout,
         outputs: tuple[str, ...] | None) -> Callable[..., Any]:
    def score(x: Any, rows: int) -> pd.Series | pd.DataFrame:
        model = shipped_model(shipment)
        empty = pd.Series([], dtype="int64" if argmax else "object")
        if not rows:
            return empty if outputs is None else pd.DataFrame({n: empty for n in outputs})
        out = _outputs(model, x, shipment.features, batch_size)
        parts = _several(out)
        if outputs is None:
            if parts is not None:
                raise ValueError(f"the model returned {len(parts)} outputs; give predict() "
                                 f"output=(name, ...) with one column name per output")
            return pd.Series(_per_row(out, argmax))
        if parts is None or len(parts) != len(outputs):
            got = 1 if parts is None else len(parts)
            raise ValueError(f"output={outputs} names {len(outputs)} columns but the model "
                             f"returned {got} output(s); give one name per output")
        return pd.DataFrame({n: _per_row(o, argmax) for n, o in zip(outputs, parts,
                                                                     strict=True)})

    def one(batches: Iterator[pd.Series]) -> Iterator[pd.Series]:
        task_threads()
        for series in batches:
            yield score(layout.inputs((series,)), len(series))  # type: ignore[misc]

    def many(batches: Iterator[Tuple[pd.Series, ...]]) -> Iterator[pd.Series]:  # noqa: UP006
        task_threads()
        for cols in batches:
            yield score(layout.inputs(tuple(cols)), len(cols[0]))  # type: ignore[misc]

    # pandas_udf reads these type hints (a struct result is yielded as a pandas DataFrame)
    return one if sum(n for _, n, _ in layout.spans) == 1 else many


def predict_dataframe(df: DataFrame, shipment: Shipment, *, features: Any,
                      output: str | tuple[str, ...] = "prediction", batch_size: int = 256,
                      argmax: bool = False) -> DataFrame:
    """``df`` with a column ``output``: the model's output per row (flattened), or its argmax.

    ``features`` is a column spec, a tuple of them or a dict of them (``Columns.features``);
    a model with several outputs needs ``output`` to name one column per output.
    """
    from pyspark.ml.functions import vector_to_array
    from pyspark.sql.functions import col, pandas_udf
    from pyspark.sql.types import (
        ArrayType,
        DoubleType,
        FloatType,
        LongType,
        StructField,
        StructType,
    )

    layout, names = _layout(features)
    missing = [n for n in names if n not in df.columns]
    if missing:
        raise ValueError(f"the DataFrame has no column(s) {missing}; its columns are "
                         f"{df.columns}. Pass features= (or inputs=) the input column name(s)")
    cols = []
    for name in names:
        kind = type(df.schema[name].dataType).__name__
        cols.append(vector_to_array(col(name)) if kind == "VectorUDT" else col(name))
    element = DoubleType() if shipment.features.dtype == "float64" else FloatType()
    one = LongType() if argmax else ArrayType(element)
    outputs = (output,) if isinstance(output, str) else tuple(output)
    if not outputs or not all(isinstance(o, str) for o in outputs):
        raise TypeError(f"output={output!r}; expected a column name, or a tuple of names (one "
                        f"per model output)")
    several = not isinstance(output, str)
    return_type = StructType([StructField(n, one) for n in outputs]) if several else one
    udf = pandas_udf(_udf(shipment, batch_size, argmax, layout,  # type: ignore[call-overload]
                          outputs if several else None), return_type)
    if not several:
        return df.withColumn(outputs[0], udf(*cols))
    scored = "__paraloom_outputs"
    return (df.withColumn(scored, udf(*cols))
            .select("*", *[col(scored)[n].alias(n) for n in outputs]).drop(scored))
