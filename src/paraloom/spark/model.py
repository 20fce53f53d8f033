"""SparkModel: fit, evaluate and predict a PyTorch model on Spark (DL4J's SparkDl4jMultiLayer)."""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal, cast, overload

import torch
from torch import nn

from paraloom.clipping import GradientClipping
from paraloom.data import cpu_copy
from paraloom.errors import WorkerError
from paraloom.evaluation import Evaluation
from paraloom.forward import LossFn
from paraloom.precision import resolve_precision
from paraloom.spark.data import (
    Columns,
    Features,
    Inputs,
    Label,
    Pair,
    Spec,
    is_dataframe,
    is_rdd,
    rows_of,
)
from paraloom.spark.data.arrow import data_chunks
from paraloom.spark.data.features import normalize_dtypes, normalize_shapes
from paraloom.spark.data.parquet import MissingColumn, ParquetSet, scan_parquet
from paraloom.spark.data.plans import compacted, parquet_files
from paraloom.spark.data.targets import column_loss
from paraloom.spark.evaluation import (
    RegressionEvaluation,
    evaluate_metrics,
    evaluate_rdd,
    predict_dataframe,
    predict_rdd,
    ship,
)
from paraloom.spark.evaluation.inference import IDS_HINT, Shipment, ids_hint
from paraloom.spark.evaluation.metrics import MetricSet
from paraloom.spark.runtime.interpreter import use_driver_python
from paraloom.spark.runtime.state import OptimizerState
from paraloom.spark.stats import TrainingStats
from paraloom.spark.training import FitJob, TrainingMaster
from paraloom.spark.training.jobs import SparkTrainingError, root_cause
from paraloom.sync.base import NoSync
from paraloom.training.optim import OptimizerFactory, OptimizerSpec
from paraloom.training.replica import StepFn
from paraloom.training.runner import WorkerSpec
from paraloom.training.step_checks import LABEL_OUTSIDE

if TYPE_CHECKING:
    from pyspark import RDD, SparkContext
    from pyspark.sql import DataFrame, SparkSession

__all__ = ["SparkModel"]

log = logging.getLogger("paraloom")



def _spark_context(spark: SparkSession | SparkContext) -> SparkContext:
    found = getattr(spark, "sparkContext", spark)
    if not hasattr(found, "broadcast") or not hasattr(found, "parallelize"):
        raise TypeError(f"spark must be a SparkSession or SparkContext; got "
                        f"{type(spark).__name__}. Spark Connect sessions have no RDD API: use "
                        f"a classic session (SparkSession.builder.master(...))")
    sc = cast("SparkContext", found)
    use_driver_python(sc)
    return sc


_LABEL_HINT = "; class labels stored as double need SparkModel(..., label_dtype=torch.long)"
_RANGE_HINT = ("; class labels must be 0 .. classes - 1 for a model with one output per "
               "class: check the label column's range (F.min / F.max), or the model's outputs")

_ONE_HOT_HINT = ("; one-hot labels are class probabilities, which CrossEntropyLoss takes as "
                 "floats: store the label column as array<float> or array<double> "
                 "(F.col(label).cast('array<float>')), or as the class index")


def _label_hint(cause: str) -> str:
    """The fix for floating-point class labels, for floating-point ids given to an embedding,
    for class labels outside the model's classes, or for integer one-hot labels, if that is
    what failed."""
    if ids_hint(cause):
        return "" if IDS_HINT in cause else IDS_HINT
    if re.search(r"Target -?\d+ is out of bounds", cause):  # unless the worker named it
        return "" if LABEL_OUTSIDE in cause else _RANGE_HINT
    if "target with class probabilities, got Long" in cause:  # an integer one-hot label
        return _ONE_HOT_HINT
    wants_long = re.search(r"Long\b.*\b(got|found) (Float|Double|Half)", cause) is not None
    return _LABEL_HINT if wants_long else ""


def _with_label_hint(error: SparkTrainingError) -> SparkTrainingError:
    """``error`` with the label_dtype fix added to its message when that is what went wrong."""
    message = str(error).split("\n\nTraceback in the worker:")[0]
    hint = _label_hint(message)
    if not hint:
        return error
    return SparkTrainingError(message + hint, worker=error.worker,
                              remote_traceback=error.remote_traceback, attempts=error.attempts)


def _check_batch_size(batch_size: int) -> None:
    """``batch_size`` of evaluate / predict: an int >= 1, checked before any Spark job."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r}; expected an int >= 1 (rows per forward "
                         f"pass)")


def _dtype_name(model: nn.Module) -> str:
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return str(dtype).removeprefix("torch.")


class SparkModel:
    """Train ``model`` on a Spark cluster with ``master``; the model then holds the result.

    ``data`` for ``fit`` / ``evaluate`` is an RDD of ``(features, label)`` pairs or a DataFrame
    with ``features=`` (one array/vector column, or a list of numeric columns) and ``label=``
    columns. Multi-input models take ``inputs=(spec, spec, ...)`` instead (called as
    ``model(*inputs)``; a dict of specs: ``model(**inputs)``), each spec a column or a list of
    columns assembled into one array; ``label=("a", "b")`` gives several targets, and the
    loss gets tuples: ``loss_fn(outputs, targets)``, or one loss per output (a list), summed.
    ``feature_shape`` reshapes each row's features for the model (e.g. ``(1, 8, 8)`` for flat
    64-value rows; one shape or None per input for ``inputs=``); ``label_dtype`` forces the
    label dtype (e.g. ``torch.long`` for a DataFrame's double labels with a classification
    loss); ``feature_dtype`` the inputs' (default: the model's floating dtype for every input;
    ``torch.long`` for an ``nn.Embedding``'s ids, kept exact; one or None per input, or a dict
    by name, as ``feature_shape``). A scalar label column against a one-unit output, with one
    of PyTorch's elementwise losses (MSE, L1, Huber, BCE), gets targets shaped like the
    output, (n, 1), as in Keras.
    ``gradient_clip_val`` / ``gradient_clip_algorithm`` clip each task's gradients before its
    optimizer steps, as ``ParallelWrapper``'s do. ``precision`` is ``ParallelWrapper``'s
    (Lightning's names): "32-true" (the default), "bf16-mixed" / "16-mixed" (autocast in
    every task; DL4J's HALF on the cluster), "bf16-true" / "16-true" (the model itself in
    that dtype); a name it does not know raises ``ValueError``.
    """

    def __init__(self, spark: SparkSession | SparkContext, model: nn.Module,
                 master: TrainingMaster, *, loss_fn: LossFn | None = None,
                 optimizer: torch.optim.Optimizer | OptimizerFactory | None = None,
                 step_fn: StepFn | None = None,
                 feature_shape: Sequence[int] | Sequence[Sequence[int] | None]
                 | dict[str, Sequence[int] | None] | None = None,
                 label_dtype: torch.dtype | None = None,
                 feature_dtype: torch.dtype | Sequence[torch.dtype | None]
                 | dict[str, torch.dtype | None] | None = None,
                 gradient_clip_val: float | None = None,
                 gradient_clip_algorithm: str = "norm", precision: str = "32-true") -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
        if not isinstance(master, TrainingMaster):
            raise TypeError(f"master must be a SharedTrainingMaster or a "
                            f"ParameterAveragingTrainingMaster; got {type(master).__name__}")
        self.sc = _spark_context(spark)
        self._session: SparkSession | None = (
            cast("SparkSession", spark) if hasattr(spark, "read") else None)
        self.model = model
        self.master = master
        self.loss_fn = loss_fn
        self.step_fn = step_fn
        self.clipping = GradientClipping.of(gradient_clip_val, gradient_clip_algorithm)
        self.precision = resolve_precision(precision).name  # a wrong name fails here
        self._user_optimizer = optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
        self._optimizer_spec = OptimizerSpec.from_user(optimizer, model) \
            if optimizer is not None else None
        self._optimizer_state: OptimizerState | None = None
        label = None if label_dtype is None else str(label_dtype).removeprefix("torch.")
        self.features = Features(normalize_shapes(feature_shape) if feature_shape else None,
                                 _dtype_name(model), label, normalize_dtypes(feature_dtype))
        self._stats: TrainingStats | None = None

    # -- training ------------------------------------------------------------------------------
    @property
    def _loss(self) -> LossFn | None:
        """``loss_fn`` as training and evaluation call it: a scalar label column lined up with
        a one-unit output (``targets.ColumnTargets``)."""
        return column_loss(self.loss_fn)

    def _optimizer_state_now(self) -> OptimizerState | None:
        """What the workers' optimizers start from: the user's optimizer as it is now (its
        param groups carry the settings, so a learning rate changed before a fit applies even
        while there is no state yet), or a factory's last state."""
        if self._user_optimizer is not None:
            return self._user_optimizer.state_dict()
        return self._optimizer_state

    def fit(self, data: RDD[object] | DataFrame, epochs: int = 1, *,
            features: Spec | None = None, label: Label = "label", inputs: Inputs | None = None,
            collect_stats: bool = False, seed: int = 0,
            prebatched: bool = False) -> dict[str, Any]:
        """Train ``epochs`` passes over ``data``; returns a summary (samples/s, losses, bytes).

        A DataFrame is read by ``features=`` (default "features") or ``inputs=``, and
        ``label=``; an RDD holds ``(features, label)`` pairs, where a tuple of arrays is several
        inputs (or targets). ``prebatched=True``: every row (element) holds a whole minibatch
        (DL4J's examplesPerDataSetObject), features ``[n, ...]`` and labels ``[n]``; the
        workers re-cut the examples into ``batch_size_per_worker`` minibatches.

        A DataFrame read straight from Parquet files (``spark.read.parquet(...)``, at most with
        a choice of its columns, an alias or ``cache()``) trains as ``fit_paths`` on those
        files does, where the master takes Parquet: each task streams its share of the row
        groups, with no shuffle. Any other DataFrame's partitions go to the tasks through
        Spark, spread over the workers first unless there are exactly ``workers`` of them.

        With ``collect_stats=True`` per-worker, per-phase timings are kept: see
        ``training_stats()``.
        """
        if is_dataframe(data):  # an RDD's elements hold their targets: no column to name
            self._check_labels(label)
        columns = self._columns(data, features, label, inputs)
        files = parquet_files(data, columns.names()) if is_dataframe(data) else None
        if files is not None and not prebatched and self.master.takes_parquet(self.sc):
            # Parquet rows as they are: each task reads its share, where every file holds the
            # columns by the DataFrame's names (Spark, ignoring case, also reads a file whose
            # names differ in case: those go through Spark)
            found = None
            with contextlib.suppress(MissingColumn):
                found = self._scan(files, columns)
            if found is not None:
                return self._fit_parquet(found, epochs, columns, collect_stats, seed)
        job = self._fit_job(epochs)
        if is_dataframe(data) or prebatched:  # DataFrames: decoded from Arrow batches
            job = replace(job, chunked=True, columns=columns if is_dataframe(data) else None,
                          from_files=files is not None)
            kept = self.master.repartition == "never"  # its partitions must stay
            rows = data_chunks(data if kept else compacted(data), columns, prebatched=prebatched)
        else:
            rows = rows_of(data, columns)
        return self._run_fit(job, rows, epochs, seed, collect_stats)

    def _run_fit(self, job: FitJob, rows: RDD[Pair] | ParquetSet, epochs: int, seed: int,
                 collect_stats: bool) -> dict[str, Any]:
        """Hand the rows to the master; adopt the state it returns."""
        try:
            result = self.master.fit(job, rows, epochs=epochs, seed=seed,
                                     collect_stats=collect_stats)
        except SparkTrainingError as e:
            hinted = _with_label_hint(e) if self.features.label_dtype is None else e
            if hinted is e:
                raise
            raise hinted from e
        with torch.no_grad():
            self.model.load_state_dict(result.state)
        self._adopt_optimizer(result.optimizer_state)
        self._stats = result.stats
        return dict(result.summary)

    def _fit_job(self, epochs: int) -> FitJob:
        """What the training master gets: the replica spec and the user's model and optimizer
        state as they are now; checks first that fit() has what it needs."""
        if self._optimizer_spec is None:
            raise ValueError("fit() needs an optimizer: SparkModel(..., optimizer=torch.optim."
                             "SGD(model.parameters(), lr=0.05)) or a factory params -> Optimizer")
        if self.loss_fn is None and self.step_fn is None:
            raise ValueError("fit() needs loss_fn= (e.g. nn.CrossEntropyLoss()) or step_fn=")
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
            raise ValueError(f"epochs={epochs!r}; expected an int >= 1")
        if self._user_optimizer is not None:  # its param groups as they are now
            self._optimizer_spec = OptimizerSpec.from_user(self._user_optimizer, self.model)
        spec = WorkerSpec(model=self.model, optimizer=self._optimizer_spec, loss_fn=self._loss,
                          step_fn=self.step_fn, synchronizer=NoSync(), clipping=self.clipping,
                          precision=self.precision)
        state = cpu_copy(self.model.state_dict())
        return FitJob(self.sc, spec, state, self._optimizer_state_now(), self.features)

    def fit_paths(self, path: str | Sequence[str], epochs: int = 1, *,
                  features: Spec | None = None, label: Label = "label",
                  inputs: Inputs | None = None, collect_stats: bool = False,
                  seed: int = 0, prebatched: bool = False) -> dict[str, Any]:
        """Train on Parquet file(s) or directories (DL4J's fitPaths): local paths or URIs that
        pyarrow opens (``hdfs://``, ``s3://``, ...), read by the executors.

        Each training task streams its own share of the row groups straight into training
        (no Spark shuffle, persist or count; the share and its order follow from ``seed``, the
        epoch and the task's rank). Before any training the driver reads the files' footers
        and a few rows: a path with no Parquet files, a missing column, files whose column
        types differ, or a column of the wrong type or shape raise ``ValueError`` or
        ``TypeError`` naming the file and the column. With ``prebatched=True``, or a master
        that runs one Spark job per round (DiLoCo, ``one_stage=False``), the files are read as
        a DataFrame (``fit``'s path). Same columns and summary as ``fit``.
        """
        paths = [path] if isinstance(path, str) else list(path)
        if not paths or not all(isinstance(p, str) for p in paths):
            raise TypeError(f"path={path!r}; expected a Parquet file or directory path (or a "
                            f"list of them)")
        self._check_labels(label)
        columns = self._columns(None, features, label, inputs)
        if prebatched or not self.master.takes_parquet(self.sc):  # fit()'s DataFrame path
            # A pre-batched row is a whole minibatch: its shape is checked where it is read.
            scan_parquet(paths, columns, check=None)
            return self.fit(self._read_parquet(paths), epochs, features=features, label=label,
                            inputs=inputs, collect_stats=collect_stats, seed=seed,
                            prebatched=prebatched)
        return self._fit_parquet(self._scan(paths, columns), epochs, columns, collect_stats,
                                 seed)

    def _fit_parquet(self, found: ParquetSet, epochs: int, columns: Columns,
                     collect_stats: bool, seed: int) -> dict[str, Any]:
        """Train on Parquet files' row groups (``_scan``), each task streaming its share."""
        job = replace(self._fit_job(epochs), chunked=True, columns=columns)
        return self._run_fit(job, found, epochs, seed, collect_stats)

    def _scan(self, paths: list[str], columns: Columns) -> ParquetSet:
        """The files' row groups, their footers and a few rows checked (``scan_parquet``)."""
        from paraloom.spark.training.task import batch_tensors

        return scan_parquet(paths, columns, check=lambda pair: batch_tensors(pair, self.features))

    def _read_parquet(self, paths: list[str]) -> DataFrame:
        from pyspark.sql import SparkSession

        session = self._session or SparkSession.getActiveSession() or SparkSession(self.sc)
        try:
            return session.read.parquet(*paths)
        except Exception as e:
            raise ValueError(f"fit_paths could not read Parquet from {paths}: "
                             f"{str(e).splitlines()[0]}") from e

    def _adopt_optimizer(self, state: OptimizerState | None) -> None:
        if state is None:
            return
        self._optimizer_state = state
        if self._user_optimizer is not None:
            try:
                self._user_optimizer.load_state_dict(state)
            except (ValueError, KeyError) as e:  # a factory-built optimizer may differ in shape
                log.debug("optimizer state not copied back: %s", e)

    def _columns(self, data: object, features: Spec | None, label: Label,
                 inputs: Inputs | None) -> Columns:
        """The columns chosen, and for a DataFrame or Parquet files (``data`` a DataFrame or
        None) ``feature_shape`` checked against the inputs they make: a mismatch fails on the
        driver, before any Spark job (the rows' own sizes are checked where they are read)."""
        columns = Columns.of(features, label, inputs)
        if is_dataframe(data):
            columns = columns.matched(data)
        if data is None or is_dataframe(data):
            self.features.shapes_for(columns.features)
        return columns

    def _check_labels(self, label: Label) -> None:
        """Training needs a label per loss: refuse one column for several (on the driver)."""
        losses = self.loss_fn if isinstance(self.loss_fn, list | tuple) else ()
        if len(losses) > 1 and isinstance(label, str):
            raise ValueError(f"loss_fn holds {len(losses)} losses (one per output) but "
                             f"label={label!r} names one column; give one per loss, e.g. "
                             f"label=({label!r}, ...)")

    def training_stats(self) -> TrainingStats | None:
        """Timings of the last ``fit(collect_stats=True)``; None if it did not collect them."""
        return self._stats

    # -- evaluation and inference --------------------------------------------------------------
    def _thresholds(self) -> tuple[float, ...]:
        """Per output: where one score per row turns class 1, 0.5 for a probability (an output
        trained with ``BCELoss``), else 0 (a logit)."""
        loss = self.loss_fn
        losses = [] if loss is None else [loss] if callable(loss) else list(loss)
        return tuple(0.5 if isinstance(f, nn.BCELoss) else 0.0 for f in losses)

    def _ship(self) -> Shipment:
        return ship(self.sc, self.model, self.features, self._thresholds())

    @overload
    def evaluate(self, data: RDD[object] | DataFrame, *, features: Spec | None = ...,
                 label: Label = ..., inputs: Inputs | None = ...,
                 output: int | str | None = ..., batch_size: int = ...,
                 metrics: None = ..., prebatched: bool = ...) -> Evaluation: ...
    @overload
    def evaluate(self, data: RDD[object] | DataFrame, *, features: Spec | None = ...,
                 label: Label = ..., inputs: Inputs | None = ...,
                 output: int | str | None = ..., batch_size: int = ...,
                 metrics: Sequence[str], prebatched: bool = ...) -> dict[str, Any]: ...
    def evaluate(self, data: RDD[object] | DataFrame, *, features: Spec | None = None,
                 label: Label = "label", inputs: Inputs | None = None,
                 output: int | str | None = None, batch_size: int = 256,
                 metrics: Sequence[str] | None = None,
                 prebatched: bool = False) -> Evaluation | dict[str, Any]:
        """Classification metrics (accuracy, precision, recall, F1, confusion matrix, loss).

        DataFrames are decoded from Arrow batches; ``prebatched=True`` as for ``fit``.

        ``metrics=["classification", "roc", "regression"]`` (any of them) computes several in
        one pass over the data and returns ``{name: Evaluation | ROC | RegressionEvaluation}``.
        A model with several outputs is evaluated on one: ``output=`` its index (or its key
        for a dict), matched with the same target of ``label=(...)``.
        """
        _check_batch_size(batch_size)
        columns = self._columns(data, features, label, inputs)
        if metrics is None:
            return self._evaluate(data, columns, output, batch_size, regression=False,
                                  prebatched=prebatched)
        names = [metrics] if isinstance(metrics, str) else list(metrics)
        MetricSet.factory(names)  # a wrong name fails here, before any Spark job
        with self._shipped() as shipment:
            chunks = data_chunks(compacted(data), columns, batch_size, prebatched)
            return evaluate_metrics(chunks, shipment, names, loss_fn=self._loss,
                                    batch_size=batch_size, output=output)

    def evaluate_regression(self, data: RDD[object] | DataFrame, *, features: Spec | None = None,
                            label: Label = "label", inputs: Inputs | None = None,
                            output: int | str | None = None, batch_size: int = 256,
                            prebatched: bool = False) -> RegressionEvaluation:
        """Regression metrics (MSE, MAE, RMSE, R² per output column, and their means)."""
        _check_batch_size(batch_size)
        columns = self._columns(data, features, label, inputs)
        return self._evaluate(data, columns, output, batch_size, regression=True,
                              prebatched=prebatched)

    @overload
    def _evaluate(self, data: RDD[object] | DataFrame, columns: Columns, output: int | str | None,
                  batch_size: int, regression: Literal[False],
                  prebatched: bool = ...) -> Evaluation: ...
    @overload
    def _evaluate(self, data: RDD[object] | DataFrame, columns: Columns, output: int | str | None,
                  batch_size: int, regression: Literal[True],
                  prebatched: bool = ...) -> RegressionEvaluation: ...
    def _evaluate(self, data: RDD[object] | DataFrame, columns: Columns, output: int | str | None,
                  batch_size: int, regression: bool,
                  prebatched: bool = False) -> Evaluation | RegressionEvaluation:
        chunks = data_chunks(compacted(data), columns, batch_size, prebatched)
        with self._shipped() as shipment:
            if regression:
                return evaluate_rdd(chunks, shipment, loss_fn=self._loss,
                                    batch_size=batch_size, regression=True, output=output)
            return evaluate_rdd(chunks, shipment, loss_fn=self._loss, batch_size=batch_size,
                                output=output)

    @contextlib.contextmanager
    def _shipped(self) -> Iterator[Shipment]:
        """The model broadcast for one evaluation job and released after it; a job that fails
        in Python raises a WorkerError with the Python error (Spark buries it in its text)."""
        from py4j.protocol import Py4JJavaError  # type: ignore[import-untyped]
        from pyspark.errors import PythonException

        shipment = self._ship()
        try:
            yield shipment
        except (Py4JJavaError, PythonException) as e:
            cause = root_cause(str(e))
            raise WorkerError(f"Spark evaluation failed: {cause}{_label_hint(cause)}") from e
        finally:
            shipment.model.unpersist()
            shipment.state.unpersist()

    @overload
    def predict(self, data: DataFrame, *, features: Spec | None = ...,
                inputs: Inputs | None = ..., output: str | tuple[str, ...] = ...,
                batch_size: int = ..., argmax: bool = ..., keyed: bool = ...,
                prebatched: bool = ...) -> DataFrame: ...
    @overload
    def predict(self, data: RDD[object], *, features: Spec | None = ...,
                inputs: Inputs | None = ..., output: str | tuple[str, ...] = ...,
                batch_size: int = ..., argmax: bool = ..., keyed: bool = ...,
                prebatched: bool = ...) -> RDD[Any]: ...
    def predict(self, data: RDD[object] | DataFrame, *, features: Spec | None = None,
                inputs: Inputs | None = None, output: str | tuple[str, ...] = "prediction",
                batch_size: int = 256, argmax: bool = False,
                keyed: bool = False, prebatched: bool = False) -> DataFrame | RDD[Any]:
        """The model's outputs: a DataFrame with an ``output`` column, or an RDD of outputs.

        A DataFrame gets one ``array<float>`` per row (the row's output, flattened), or with
        ``argmax=True`` the class index as a long; a model with several outputs needs
        ``output=("a", "b", ...)``, one new column per output. An RDD of features gives one
        numpy array (or class index, or a tuple of them for several outputs) per element, in
        order; with ``keyed=True`` it holds ``(key, features)`` pairs and gives
        ``(key, output)`` pairs (DL4J's feedForwardWithKey). ``prebatched=True``: each row
        (element) is a minibatch of ``n`` examples and gets ``n`` outputs: a list per row in a
        DataFrame (``array<array<float>>``, or ``array<long>`` with ``argmax``), one array per
        element in an RDD.
        """
        _check_batch_size(batch_size)
        if is_dataframe(data):
            columns = self._columns(data, features, "label", inputs)
            return predict_dataframe(data, self._ship(),
                                     features=columns.features, output=output,
                                     batch_size=batch_size, argmax=argmax, prebatched=prebatched)
        shipment = self._ship()
        if is_rdd(data):
            return predict_rdd(data, shipment, batch_size=batch_size, argmax=argmax, keyed=keyed,
                               prebatched=prebatched)
        raise TypeError(f"data must be a pyspark DataFrame or RDD; got {type(data).__name__}")

    def __repr__(self) -> str:
        return f"SparkModel({type(self.model).__name__}, {self.master!r})"
