"""Predictions over DataFrames: an iterator Arrow UDF scores record batches (decoded column by
column, as for training) and adds one column per model output."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from paraloom.spark.data import FieldSpec
from paraloom.spark.data.arrow import arrow_columns, check_prebatched
from paraloom.spark.data.rows import check_names, folds_case
from paraloom.spark.evaluation.inference import (
    Shipment,
    model_outputs,
    numpy_of,
    output_parts,
    row_outputs,
    shipped_model,
)
from paraloom.spark.runtime import task_threads

if TYPE_CHECKING:
    import pyarrow as pa  # type: ignore[import-untyped]
    from pyspark.sql import DataFrame
    from pyspark.sql.pandas._typing import ArrowScalarIterFunction
    from pyspark.sql.types import DataType

__all__ = ["predict_dataframe"]


def _layout(features: FieldSpec) -> list[str]:
    """Every column an input spec (one, a tuple or a dict of them) reads, once each."""
    specs = (list(features.values()) if isinstance(features, dict)
             else list(features) if isinstance(features, tuple) else [features])
    names: list[str] = []
    for spec in specs:
        for name in ([spec] if isinstance(spec, str) else spec):
            if name not in names:
                names.append(name)
    return names


def _arrow_output(out: torch.Tensor, argmax: bool, dtype: str,
                  threshold: float = 0.0) -> pa.Array:
    """One output per row as an Arrow array: the class index (int64), or the flattened row."""
    import pyarrow as pa

    if argmax:
        return pa.array(np.asarray(row_outputs(out, argmax, threshold), dtype=np.int64),
                        pa.int64())
    flat = numpy_of(out.reshape(len(out), -1)).astype(
        "float64" if dtype == "float64" else "float32", copy=False)  # the column's type
    width = flat.shape[1]
    offsets = np.arange(0, (len(flat) + 1) * width, width, dtype=np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat.reshape(-1)))


def _arrow_udf(shipment: Shipment, batch_size: int, argmax: bool, features: FieldSpec,
               names: list[str], outputs: tuple[str, ...] | None, empty: pa.DataType,
               prebatched: bool = False) -> ArrowScalarIterFunction:
    from paraloom.spark.data.arrow import arrow_field, unbatch

    dtype = shipment.features.dtype

    def score(cols: tuple[pa.Array, ...]) -> pa.Array:
        import pyarrow as pa

        if not len(cols[0]):
            return pa.array([], empty)
        by_name = dict(zip(names, cols, strict=True))
        rows, per_row = len(cols[0]), None
        if prebatched:  # every row a minibatch: score its examples, give them back per row
            by_name, counts = unbatch(by_name)
            rows, per_row = int(counts.sum()), pa.array(
                np.concatenate([[0], np.cumsum(counts)]).astype(np.int32))
            if not rows:  # only empty minibatches: nothing to run the model on
                value: list[object] | dict[str, list[object]] = (
                    [] if outputs is None else dict.fromkeys(outputs, []))
                return pa.array([value] * len(counts), empty)
        x = arrow_field(by_name.__getitem__, rows, features)
        out = model_outputs(shipped_model(shipment), x, shipment.features, batch_size)

        def column(o: torch.Tensor, i: int) -> pa.Array:
            one = _arrow_output(o, argmax, dtype, shipment.threshold(i))
            return one if per_row is None else pa.ListArray.from_arrays(per_row, one)

        return _output_columns(out, outputs, column)

    def run(batches: Iterator[pa.Array | tuple[pa.Array, ...]]) -> Iterator[pa.Array]:
        task_threads()
        for cols in batches:
            yield score(cols if isinstance(cols, tuple) else (cols,))

    return run


def _output_columns(out: Any, outputs: tuple[str, ...] | None,
                    column: Callable[[torch.Tensor, int], pa.Array]) -> pa.Array:
    """The model's output as the UDF's result: one column, or a struct of one per output."""
    import pyarrow as pa

    parts = output_parts(out)
    if outputs is None:
        if parts is not None and len(parts) == 1:  # a model that returns (logits,)
            return column(parts[0], 0)
        if parts is not None:
            raise ValueError(f"the model returned {len(parts)} outputs but output= names "
                             f"one column; give predict() output=(name, ...) with one column "
                             f"name per output ({len(parts)} names)")
        return column(out, 0)
    if parts is None or len(parts) != len(outputs):
        got = 1 if parts is None else len(parts)
        raise ValueError(f"output={outputs} names {len(outputs)} columns but the model "
                         f"returned {got} output(s); give one name per output")
    return pa.StructArray.from_arrays([column(o, i) for i, o in enumerate(parts)],
                                      names=list(outputs))


def _output_names(output: str | tuple[str, ...]) -> tuple[str, ...]:
    outputs = (output,) if isinstance(output, str) else tuple(output)
    if not outputs or not all(isinstance(o, str) for o in outputs):
        raise TypeError(f"output={output!r}; expected a column name, or a tuple of names (one "
                        f"per model output)")
    return outputs


def _result_types(float64: bool, argmax: bool, prebatched: bool,
                  outputs: tuple[str, ...] | None) -> tuple[DataType, pa.DataType]:
    """The UDF's Spark return type, and the same as an Arrow type (for empty batches): per
    output a class index or a flattened row, a list of them per pre-batched row; a struct of
    them for several ``outputs``."""
    import pyarrow as pa
    from pyspark.sql.types import (
        ArrayType,
        DoubleType,
        FloatType,
        LongType,
        StructField,
        StructType,
    )

    one: DataType = LongType() if argmax else ArrayType(DoubleType() if float64 else FloatType())
    one_pa = pa.int64() if argmax else pa.list_(pa.float64() if float64 else pa.float32())
    if prebatched:  # one output per example: a list of them per row
        one, one_pa = ArrayType(one), pa.list_(one_pa)
    if outputs is None:
        return one, one_pa
    return (StructType([StructField(n, one) for n in outputs]),
            pa.struct([(n, one_pa) for n in outputs]))


def _check_new_columns(df: DataFrame, outputs: tuple[str, ...]) -> None:
    """Output names must be new and distinct: predict adds columns, it never replaces one (a
    label column overwritten would be lost; two of one name are ambiguous), as Spark ML."""
    fold = folds_case(df)
    existing = {c.lower() if fold else c for c in df.columns}
    taken = [o for o in outputs if (o.lower() if fold else o) in existing]
    if taken:
        raise ValueError(f"output column(s) {taken} already exist in the DataFrame (its columns "
                         f"are {df.columns}); predict adds new columns: pass output= other "
                         f"names, or drop those columns first")
    if len({o.lower() if fold else o for o in outputs}) != len(outputs):
        raise ValueError(f"output={outputs} names a column twice; give one distinct name per "
                         f"model output")


def predict_dataframe(df: DataFrame, shipment: Shipment, *, features: FieldSpec,
                      output: str | tuple[str, ...] = "prediction", batch_size: int = 256,
                      argmax: bool = False, prebatched: bool = False) -> DataFrame:
    """``df`` with a column ``output``: the model's output per row (flattened), or its argmax.

    ``features`` is a column spec, a tuple of them or a dict of them (``Columns.features``);
    a model with several outputs needs ``output`` to name one column per output.
    ``prebatched``: every row holds a minibatch (lists of ``n`` examples) and gets a list of
    ``n`` outputs.
    """
    from pyspark.sql.functions import col
    from pyspark.sql.pandas.functions import ArrowUDFType, arrow_udf

    names = check_names(df, _layout(features), "features= (or inputs=)")
    if prebatched:
        check_prebatched(df, names)
    cols = arrow_columns(df, names)
    outputs = _output_names(output)
    _check_new_columns(df, outputs)
    several = outputs if len(outputs) > 1 else None  # one name: one column, tuple or not
    return_type, empty = _result_types(shipment.features.dtype == "float64", argmax, prebatched,
                                       several)
    # A struct return type is allowed (documented), though pyspark's overloads omit it.
    with warnings.catch_warnings():  # "prefer type hints": the type is given, hints need pa
        warnings.simplefilter("ignore", UserWarning)
        udf = arrow_udf(_arrow_udf(shipment, batch_size, argmax, features, names,  # type: ignore[call-overload]
                                   several, empty, prebatched),
                        return_type, ArrowUDFType.SCALAR_ITER)
    if several is None:
        return df.withColumn(outputs[0], udf(*cols))
    scored = "__paraloom_outputs"
    return (df.withColumn(scored, udf(*cols))
            .select("*", *[col(scored)[n].alias(n) for n in outputs]).drop(scored))
