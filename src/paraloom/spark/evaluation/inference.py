"""Distributed evaluation and inference: the model travels once per job, cached per worker.

The driver broadcasts the model (cloudpickled structure) and its parameters (safetensors
bytes); each executor Python process builds it once per parameter version and keeps it in the
``runtime.executor.cached`` LRU, as ``predict_batch_udf`` does. Evaluation merges
per-partition metric states with ``treeAggregate``; RDDs are scored by ``mapPartitions``,
DataFrames by an iterator Arrow UDF (``frames.py``). A forward pass that fails raises a
``BatchError`` describing its batch: predict is lazy, so that is what the user's action shows.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast, overload

import cloudpickle
import numpy as np
import torch
from torch import nn

from paraloom.data import batch_size as batch_size_of
from paraloom.data import map_tensors
from paraloom.errors import NotPicklableError
from paraloom.evaluation import Evaluation, update_with_loss
from paraloom.forward import LossFn, batch_total, compute_loss, forward
from paraloom.spark.data import Arrays, Features, Pair, Tensors, num_rows, take
from paraloom.spark.data.arrays import stack
from paraloom.spark.data.rows import field
from paraloom.spark.evaluation.metrics import (
    MetricSet,
    MetricState,
    RegressionEvaluation,
    StateBuilder,
    merge_evaluations,
    metric_factory,
)
from paraloom.spark.runtime import cached, pack, task_threads, unpack
from paraloom.training.parametrized import by_value
from paraloom.training.step_checks import BatchError, batch_error

if TYPE_CHECKING:
    from pyspark import RDD, Broadcast, SparkContext

__all__ = ["Shipment", "ship", "shipped_model", "evaluate_rdd", "evaluate_metrics", "predict_rdd",
           "model_outputs", "numpy_of", "output_parts", "row_outputs"]

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
    thresholds: tuple[float, ...] = ()
    """Per output: where one score per row turns class 1 for ``argmax`` (0 if not given)."""

    def threshold(self, output: int) -> float:
        """Output ``output``'s class-1 threshold for one score per row."""
        return self.thresholds[output] if 0 <= output < len(self.thresholds) else 0.0


def ship(sc: SparkContext, model: nn.Module, features: Features,
         thresholds: tuple[float, ...] = ()) -> Shipment:
    """Broadcast ``model`` (structure and current parameters) for evaluation or inference."""
    state = pack({k: v for k, v in model.state_dict().items()})
    try:
        structure = by_value(model)
    except Exception as e:  # a lock, an open file, a TorchScript module: named, with the fix
        raise NotPicklableError(
            f"cannot send the model to the Spark executors: {type(e).__name__}: {e}. Keep "
            "open files, locks, threads, sockets and the SparkSession out of it; define "
            "classes and functions at module level or in the notebook") from e
    # Both in the key: the same parameters in another module (an activation swapped, a plain
    # attribute changed) must not find the cached model in a reused Python process.
    key = hashlib.sha256(hashlib.sha256(structure).digest() + state).hexdigest()[:24]
    return Shipment(key, sc.broadcast(structure), sc.broadcast(state), features, thresholds)


def shipped_model(shipment: Shipment) -> nn.Module:
    """The shipment's model in this Python process, in eval mode (built once, then cached)."""
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


IDS_HINT = ("; integer ids (an nn.Embedding's input) need SparkModel(..., "
            "feature_dtype=torch.long), which keeps them exact")
"""The fix for floating-point ids given to an embedding (``ids_hint``)."""


def ids_hint(cause: str) -> str:
    """``IDS_HINT`` where ``cause`` (an error's text) is an embedding given floats, else ""."""
    return IDS_HINT if re.search(r"'indices'.*Long.*but got torch\.\w*(Float|Double|Half)",
                                 cause) else ""


@torch.no_grad()
def model_outputs(model: nn.Module, x: Arrays, features: Features, batch_size: int) -> Any:
    inputs = features.features(x)
    n = batch_size_of(inputs)
    def run(start: int) -> Any:
        rows = map_tensors(inputs, lambda t: t[start:start + batch_size])
        try:
            return forward(model, rows)
        except Exception as e:  # predict's errors reach the user's action, raised in a worker
            error = batch_error(e, rows)
            raise BatchError(f"{error}{ids_hint(str(e))}") from e

    return _cat([run(i) for i in range(0, n, batch_size)])


def pick_output(out: Any, targets: Tensors,
                output: int | str | None) -> tuple[Any, Any]:
    """The one output (and target) a metric counts: ``output`` of several, else the only one."""
    several = isinstance(out, (tuple, list, dict))
    if output is None:
        if several:
            raise ValueError(f"the model returned {len(out)} outputs; evaluate one at a time "
                             f"with output=0 .. {len(out) - 1} (or its name for a dict)")
        return out, targets
    if not several:
        if output in (0, -1):
            return out, targets[output] if isinstance(targets, tuple) else targets
        raise ValueError(f"output={output!r} but the model returned one output; leave output "
                         f"unset")
    position = _position(out, output)
    if position is None:
        names = list(out) if isinstance(out, dict) else list(range(len(out)))
        raise ValueError(f"output={output!r} but the model returned {len(out)} outputs "
                         f"({names}); give one of those")
    chosen = list(out.values())[position] if isinstance(out, dict) else out[position]
    if isinstance(targets, dict):
        return chosen, _pick(targets, out, position)
    if isinstance(targets, tuple):  # the label columns, in the outputs' order
        return chosen, targets[position]
    return chosen, targets


def _position(out: Any, output: int | str | None) -> int | None:
    """Where output ``output`` (a dict's key, or an index, a dict's too) is among the model's
    outputs; None if it is not one of them, or the model returned one."""
    if not isinstance(out, (tuple, list, dict)) or output is None:
        return None
    if isinstance(output, str):
        return list(out).index(output) if isinstance(out, dict) and output in out else None
    if isinstance(output, bool) or not -len(out) <= output < len(out):
        return None
    return output % len(out)  # an index: a dict's in its order


def _pick(targets: dict[str, torch.Tensor], out: Any, position: int) -> torch.Tensor:
    """The target of the output at ``position``: under its key for a dict of outputs (a
    ``KeyError`` if the targets have none), else at the same position."""
    if isinstance(out, dict):
        return targets[list(out)[position]]
    return list(targets.values())[position]


def _loss(loss_fn: LossFn | None, out: Any, targets: Tensors, chosen: Any, target: Any,
          output: int | str | None, rows: int) -> Callable[[], torch.Tensor] | None:
    """The batch's loss summed over its ``rows``: the model's (``compute_loss``), or, for one
    loss per output with a single label column, the evaluated output's own loss against it."""
    if loss_fn is None:
        return None
    position = _position(out, output)
    if isinstance(loss_fn, Sequence) and not isinstance(loss_fn, nn.Module) \
            and position is not None and not isinstance(targets, (tuple, dict)) \
            and len(loss_fn) == len(out):  # else compute_loss names the mismatch
        return functools.partial(batch_total(loss_fn[position], rows), chosen, target)
    return functools.partial(compute_loss, batch_total(loss_fn, rows), out, targets)


def _chunks(rows: Iterable[T], size: int) -> Iterator[list[T]]:
    it = iter(rows)
    while chunk := list(itertools.islice(it, size)):
        yield chunk


def _slices(chunks: Iterable[Pair], size: int) -> Iterator[Pair]:
    """Chunks cut to at most ``size`` rows (never joined: metrics add up per slice)."""
    for x, y in chunks:
        n = num_rows(x)
        for start in range(0, n, size):
            part = slice(start, start + size)
            yield (take(x, part), take(y, part)) if n > size else (x, y)


def _evaluate_partition(shipment: Shipment, loss_fn: LossFn | None, batch_size: int,
                        new_state: StateBuilder[S], output: int | str | None,
                        chunks: Iterable[Pair]) -> Iterator[S | None]:
    task_threads()
    model = shipped_model(shipment)
    state: S | None = None
    for x, y in _slices(chunks, batch_size):
        inputs = shipment.features.features(x)
        try:
            with torch.no_grad():
                out = forward(model, inputs)
        except Exception as e:
            raise batch_error(e, inputs) from e
        targets = shipment.features.labels(y)
        chosen, target = pick_output(out, targets, output)
        if state is None:  # the counted output's threshold: a dict's key is known by now
            state = new_state(chosen, shipment.threshold(_position(out, output) or 0))
        update_with_loss(state, chosen, target,
                         _loss(loss_fn, out, targets, chosen, target, output, num_rows(y)))
    yield state


def _aggregate(chunks: RDD[Pair], shipment: Shipment, loss_fn: LossFn | None, batch_size: int,
               new_state: StateBuilder[S], depth: int,
               output: int | str | None = None) -> S:
    def run(part: Iterable[Pair]) -> Iterator[S | None]:
        return _evaluate_partition(shipment, loss_fn, batch_size, new_state, output, part)

    zero: S | None = None
    result = chunks.mapPartitions(run).treeAggregate(zero, merge_evaluations, merge_evaluations,
                                                   depth=depth)
    if result is None:
        raise ValueError("no rows to evaluate: the data is empty")
    return result


@overload
def evaluate_rdd(chunks: RDD[Pair], shipment: Shipment, *, loss_fn: LossFn | None = None,
                 batch_size: int = 256, regression: Literal[False] = False,
                 depth: int = 2, output: int | str | None = None) -> Evaluation: ...
@overload
def evaluate_rdd(chunks: RDD[Pair], shipment: Shipment, *, loss_fn: LossFn | None = None,
                 batch_size: int = 256, regression: Literal[True],
                 depth: int = 2, output: int | str | None = None) -> RegressionEvaluation: ...
def evaluate_rdd(chunks: RDD[Pair], shipment: Shipment, *, loss_fn: LossFn | None = None,
                 batch_size: int = 256, regression: bool = False,
                 depth: int = 2,
                 output: int | str | None = None) -> Evaluation | RegressionEvaluation:
    """Evaluation (or RegressionEvaluation) of chunks of stacked ``(features, label)`` rows
    (``data.arrow.data_chunks``) via treeAggregate.

    ``output`` picks which of a multi-output model's outputs (and targets) is counted; one
    score per row of it turns class 1 above the shipment's threshold for that output (0.5 for
    probabilities, an output trained with BCELoss).
    """
    new_state = metric_factory("regression" if regression else "classification")
    state = _aggregate(chunks, shipment, loss_fn, batch_size, new_state, depth, output)
    return cast("Evaluation | RegressionEvaluation", state)


def evaluate_metrics(chunks: RDD[Pair], shipment: Shipment, metrics: Sequence[str], *,
                     loss_fn: LossFn | None = None, batch_size: int = 256, depth: int = 2,
                     output: int | str | None = None) -> dict[str, MetricState]:
    """Several metrics (``metrics.METRICS`` names) of chunks of rows, in one pass."""
    result = _aggregate(chunks, shipment, loss_fn, batch_size,
                        MetricSet.factory(metrics), depth, output)
    return dict(result.states)


def row_outputs(out: torch.Tensor, argmax: bool,
                threshold: float = 0.0) -> list[int] | list[np.ndarray]:
    if argmax:
        if out.is_floating_point() and bool(torch.isnan(out).any()):
            raise ValueError("predict(argmax=True): the model's outputs hold NaN, which have "
                             "no class (NaN or inf in the input features? a diverged model? "
                             "check the data, then the training loss); predict without "
                             "argmax to see the outputs")
        if out.dim() == 1 or (out.dim() == 2 and out.shape[1] == 1):
            # one score per row: class 1 above the threshold (0 for a logit, 0.5 for a
            # probability), as evaluate counts it (an argmax over one column is always 0)
            return (out.reshape(-1) > threshold).long().tolist()
        if out.dim() != 2:
            raise ValueError(f"argmax=True needs outputs of shape (rows, classes); the model "
                             f"returned shape {tuple(out.shape)}. Leave argmax unset and take "
                             "the argmax of each row's output yourself (it comes flattened)")
        return out.argmax(dim=1).tolist()
    return list(numpy_of(out.reshape(len(out), -1)))


def numpy_of(out: torch.Tensor) -> np.ndarray:
    """``out`` as numpy on the CPU; bfloat16, which numpy lacks, as float32."""
    out = out.detach().cpu()
    return (out.float() if out.dtype == torch.bfloat16 else out).numpy()


def output_parts(out: Any) -> list[torch.Tensor] | None:
    """A multi-output model's outputs in order (a dict's in its order); None for one tensor."""
    if isinstance(out, dict):
        return list(out.values())
    if isinstance(out, (tuple, list)):
        return list(out)
    return None


def _whole(out: torch.Tensor, argmax: bool, threshold: float = 0.0) -> np.ndarray:
    """A pre-batched element's outputs: class indices (n,), or the rows (n, ...) as numpy."""
    if argmax:
        return np.asarray(row_outputs(out, argmax, threshold), dtype=np.int64)
    return numpy_of(out)


def predict_rdd(rdd: RDD[object], shipment: Shipment, *, batch_size: int = 256,
                argmax: bool = False, keyed: bool = False, prebatched: bool = False) -> RDD[Any]:
    """Outputs for an RDD of features (same order), or of ``(key, features)`` pairs.

    Features that are a tuple (or dict) of arrays are several inputs; a model with several
    outputs gives a tuple per row. ``prebatched``: each element is a minibatch of ``n`` rows
    and gets one array of ``n`` outputs (a tuple of them for several outputs).
    """
    def run_batches(elements: Iterable[Any]) -> Iterator[Any]:
        task_threads()
        model = shipped_model(shipment)
        for element in elements:
            key, x = element if keyed else (None, element)
            out = model_outputs(model, field(x), shipment.features, batch_size)
            parts = output_parts(out)
            result = (_whole(out, argmax, shipment.threshold(0)) if parts is None else
                      tuple(_whole(o, argmax, shipment.threshold(i)) for i, o in enumerate(parts)))
            yield (key, result) if keyed else result

    def run(rows: Iterable[Any]) -> Iterator[Any]:
        task_threads()
        model = shipped_model(shipment)
        for chunk in _chunks(rows, batch_size):
            keys = [k for k, _ in chunk] if keyed else None
            x = stack([field(f) for f in ([f for _, f in chunk] if keyed else chunk)])
            out = model_outputs(model, x, shipment.features, batch_size)
            parts = output_parts(out)
            per_row = (row_outputs(out, argmax, shipment.threshold(0)) if parts is None else
                       list(zip(*[row_outputs(o, argmax, shipment.threshold(i))
                                  for i, o in enumerate(parts)], strict=True)))
            yield from (zip(keys, per_row, strict=True) if keys is not None else per_row)

    return rdd.mapPartitions(run_batches if prebatched else run)
