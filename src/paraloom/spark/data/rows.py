"""Rows in: RDD elements and DataFrame rows as ``(features, label)`` numpy pairs.

Several inputs or targets are tuples (or dicts) of arrays; ``Columns`` says which DataFrame
columns make each.

Every element a master trains on or evaluates comes from ``as_rows``; ``to_array`` accepts
numbers, lists, numpy arrays, tensors and Spark ML vectors.
"""

from __future__ import annotations

import decimal
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeGuard, cast

import numpy as np
import torch

from paraloom.spark.data.arrays import Arrays, map_arrays, stack

if TYPE_CHECKING:
    from numpy.typing import ArrayLike
    from pyspark import RDD
    from pyspark.sql import Column, DataFrame, Row
    from pyspark.sql.types import DataType

__all__ = ["Pair", "field", "Spec", "FieldSpec", "Inputs", "Label", "Columns", "to_array",
           "row_pair", "partition_arrays", "as_rows", "rows_of", "row_extractor", "check_columns",
           "spark_column", "whole_decimal",
           "cast_hint", "check_names", "column", "folds_case", "is_dataframe", "is_rdd"]

Pair = tuple[Arrays, Arrays]
"""One element, or a stack of them: (features, label), each an array or a tuple / dict of them
(see ``arrays.Arrays``)."""


def to_array(value: object) -> np.ndarray:
    """A feature or label value (number, list, numpy array, tensor, Spark ML vector) as numpy."""
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    to_numpy = getattr(value, "toArray", None)  # pyspark.ml.linalg DenseVector / SparseVector
    if to_numpy is not None:
        return np.asarray(to_numpy())
    array = np.asarray(value)
    if array.dtype.kind in "OUS":  # Decimal (a decimal column's df.rdd), str, None, ragged
        flat = array.reshape(-1)
        if array.dtype == object and all(isinstance(v, numbers.Number | decimal.Decimal)
                                         and not isinstance(v, bool) for v in flat):
            return array.astype(np.float64)  # Decimals, perhaps beside floats
        kinds = sorted({type(v).__name__ for v in flat[:100]})
        raise TypeError(f"a value holds {kinds} where numbers are expected (null, text, or "
                        "arrays of unequal lengths); cast or fill the column first "
                        "(F.col(c).cast('double'), df.na.drop()), or map the rows to numbers")
    return array


def _is_scalar(value: object) -> bool:
    # np.ndim takes any object (0 for what is not array-like), wider than its stub says
    return np.ndim(cast("ArrayLike", value)) == 0 and not isinstance(value, (list, tuple, dict))


def field(value: object, *, label: bool = False) -> Arrays:
    """An RDD element's features or label: one array, or a tuple / dict of them (several).

    Features: a tuple holding any array-like value is several inputs (DL4J's MultiDataSet); a
    tuple of numbers, a list, an array, a tensor or a vector is one array. Labels: a tuple is
    always several targets (give one vector target as a list or an array).
    """
    if isinstance(value, dict):
        return {str(k): to_array(v) for k, v in value.items()}
    if isinstance(value, tuple) and value and (label or not all(_is_scalar(v) for v in value)):
        return tuple(to_array(v) for v in value)
    return to_array(value)


def row_pair(row: object) -> Pair:
    """One training element as ``(features, label)``: arrays, or tuples / dicts of arrays."""
    if not isinstance(row, (tuple, list)) or len(row) != 2:
        raise TypeError(f"a training element must be a pair (features, label); got "
                        f"{type(row).__name__}. "
                        f"Map your RDD to (features, label) tuples, or pass a DataFrame with "
                        f"features= and label= column names")
    return field(row[0]), field(row[1], label=True)


def partition_arrays(pairs: Iterable[Pair]) -> Pair:
    """Stack ``(features, label)`` rows into arrays per field (empty arrays for no rows)."""
    xs, ys = [], []
    for x, y in pairs:
        xs.append(map_arrays(to_array, x))
        ys.append(map_arrays(to_array, y))
    if not xs:
        return np.zeros((0,), np.float32), np.zeros((0,), np.int64)
    return stack(xs, "feature"), stack(ys, "label")


def is_dataframe(data: object) -> TypeGuard[DataFrame]:
    """True for a pyspark DataFrame (anything whose type has ``rdd`` and ``columns``). The
    type is asked, not the object: ``DataFrame.rdd`` builds an RDD, and raises on a streaming
    DataFrame."""
    return hasattr(type(data), "rdd") and hasattr(type(data), "columns")


def is_rdd(data: object) -> TypeGuard[RDD[object]]:
    """True for a pyspark RDD (anything with ``mapPartitions``)."""
    return hasattr(data, "mapPartitions")


Spec = str | Sequence[str]
"""One column, or a list of columns assembled into one flat array per row."""

Inputs = Sequence[Spec] | Mapping[str, Spec]
"""Several model inputs: specs in the model's argument order, or by keyword."""

Label = Spec | tuple[Spec, ...]
"""One target (a column, or a list of columns assembled), or a tuple of them: one per output."""

FieldSpec = Spec | tuple[Spec, ...] | dict[str, Spec]
"""The columns of a field, as read: one spec, a tuple of specs (``model(*inputs)``, several
targets) or a dict of them (``model(**inputs)``)."""


@dataclass(frozen=True)
class Columns:
    """Which DataFrame columns make a row's features and label, and in what structure."""

    features: FieldSpec
    """A spec (one input), a tuple of specs (``model(*inputs)``) or a dict (``model(**inputs)``)."""
    label: Spec | tuple[Spec, ...]

    @classmethod
    def of(cls, features: Spec | None = None, label: Label = "label",
           inputs: Inputs | None = None) -> Columns:
        """Columns from ``features=`` or ``inputs=`` and ``label=``, checked."""
        if inputs is not None and features is not None:
            raise ValueError("give either features= (one model input) or inputs= (several), "
                             "not both")
        chosen: FieldSpec
        if inputs is None:
            chosen = _spec(features if features is not None else "features", "features")
        elif isinstance(inputs, Mapping):
            if not inputs:
                raise ValueError("inputs={} names no input; give {'arg': column, ...}")
            chosen = {str(k): _spec(v, f"inputs[{k!r}]") for k, v in inputs.items()}
        elif isinstance(inputs, (tuple, list)) and inputs:
            chosen = tuple(_spec(v, f"inputs[{i}]") for i, v in enumerate(inputs))
        else:
            raise TypeError(f"inputs={inputs!r}; expected a tuple of column specs (a column "
                            f"name, or a list of columns assembled into one array) or a dict "
                            f"of them by argument name")
        target: Spec | tuple[Spec, ...] = (
            tuple(_spec(v, f"label[{i}]") for i, v in enumerate(label))
            if isinstance(label, tuple) else _spec(label, "label"))
        return cls(chosen, target)

    def names(self) -> list[str]:
        """Every column these specs read, once each, in order."""
        out: list[str] = []
        for spec in [*_specs(self.features), *_specs(self.label)]:
            for name in ([spec] if isinstance(spec, str) else spec):
                if name not in out:
                    out.append(name)
        return out

    def matched(self, df: DataFrame) -> Columns:
        """These columns named as ``df`` names them, where the session folds case
        (``spark.sql.caseSensitive`` false, Spark's default, as ``df.select`` does): a
        ``label`` given for a ``Label`` column (a CSV header's) reads ``Label``."""
        if not folds_case(df):
            return self
        actual: dict[str, list[str]] = {}
        for c in df.columns:
            actual.setdefault(c.lower(), []).append(c)
        names = {n: found[0] for n in self.names() if n not in df.columns
                 and len(found := actual.get(n.lower(), [])) == 1}
        if not names:
            return self

        def rename(spec: Spec) -> Spec:
            return names.get(spec, spec) if isinstance(spec, str) \
                else [names.get(c, c) for c in spec]

        features = self.features
        features = tuple(rename(s) for s in features) if isinstance(features, tuple) else \
            {k: rename(v) for k, v in features.items()} if isinstance(features, dict) else \
            rename(features)
        label = tuple(rename(s) for s in self.label) if isinstance(self.label, tuple) \
            else rename(self.label)
        return Columns(features, label)

    def inputs(self) -> int:
        """How many model inputs (1 for ``features=``)."""
        return len(_specs(self.features))

    def outputs(self) -> int:
        """How many targets (1 for one label)."""
        return len(self.label) if isinstance(self.label, tuple) else 1


def folds_case(df: DataFrame) -> bool:
    """Whether the session folds column names' case (``spark.sql.caseSensitive``, false by
    default): ``Label`` then names ``label``."""
    return str(df.sparkSession.conf.get("spark.sql.caseSensitive", "false")).lower() != "true"


def _spec(value: object, what: str) -> Spec:
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and value and all(isinstance(c, str) for c in value):
        return list(value)
    raise TypeError(f"{what}={value!r}; expected a column name or a non-empty list of column "
                    f"names (assembled into one array)")


def _specs(field: FieldSpec) -> list[Spec]:
    if isinstance(field, tuple):
        return list(field)
    if isinstance(field, dict):
        return list(field.values())
    return [field]


def _column(row: Row, spec: Spec) -> np.ndarray:
    if isinstance(spec, str):
        return to_array(row[spec])
    if len(spec) == 1:
        return np.ravel(to_array(row[spec[0]]))
    return np.concatenate([np.ravel(to_array(row[c])) for c in spec])


def _extract(row: Row, field: FieldSpec) -> Arrays:
    if isinstance(field, tuple):
        return tuple(_column(row, s) for s in field)
    if isinstance(field, dict):
        return {k: _column(row, s) for k, s in field.items()}
    return _column(row, field)


def row_extractor(columns: Columns) -> Callable[[Row], Pair]:
    """A function from a DataFrame row to its ``(features, label)`` arrays."""
    return lambda row: (_extract(row, columns.features), _extract(row, columns.label))


def _numeric(kind: DataType, depth: int = 0) -> bool:
    """A Spark type torch can take: numbers, booleans, (nested) arrays of them, ML vectors."""
    from pyspark.sql.types import ArrayType, BooleanType, DecimalType, NumericType

    if isinstance(kind, ArrayType):
        return _numeric(kind.elementType, depth + 1)
    if isinstance(kind, DecimalType):  # read as longs or doubles (see spark_column)
        return True
    if type(kind).__name__ == "VectorUDT":
        return depth == 0  # vector_to_array converts top-level vector columns only
    return isinstance(kind, (NumericType, BooleanType))


def column(name: str) -> Column:
    """The column called ``name``, taken literally: a dot or a backtick in it (``sepal.length``,
    as in many CSV headers) is part of the name, not a struct field or a quote."""
    from pyspark.sql.functions import col

    return col("`" + name.replace("`", "``") + "`")


def whole_decimal(precision: int, scale: int) -> bool:
    """Whether a decimal type holds whole numbers that fit a long (at most 18 digits, no
    fraction): such decimals are read as longs, the others as doubles."""
    return scale == 0 and precision <= 18


def _decimals_read_as(kind: DataType) -> DataType | None:
    """The type a decimal (or an array of decimals) is read as: long for whole numbers of at
    most 18 digits (``decimal(p, 0)``: class labels, counts), double otherwise; None for
    other types."""
    from pyspark.sql.types import ArrayType, DecimalType, DoubleType, LongType

    if isinstance(kind, DecimalType):
        return LongType() if whole_decimal(kind.precision, kind.scale) else DoubleType()
    if isinstance(kind, ArrayType):
        inner = _decimals_read_as(kind.elementType)
        return None if inner is None else ArrayType(inner, kind.containsNull)
    return None


def spark_column(df: DataFrame, name: str) -> Column:
    """``df``'s column ``name`` as the data is read: decimals (a database's prices, amounts
    and ids, exact in Spark) cast to long or double (see ``_decimals_read_as``), which numpy
    and torch hold."""
    read_as = _decimals_read_as(df.schema[name].dataType)
    return column(name) if read_as is None else column(name).cast(read_as)


def check_names(df: DataFrame, names: list[str], what: str) -> list[str]:
    """``names``, checked on the driver: every one a column of ``df`` holding numbers.

    A missing or non-numeric column fails here, before any Spark job, naming the fix.
    """
    missing = [c for c in names if c not in df.columns]
    if missing:
        raise ValueError(f"the DataFrame has no column(s) {missing}; its columns are "
                         f"{df.columns}. Pass {what} column names")
    wrong = {c: df.schema[c].dataType.simpleString() for c in names
             if not _numeric(df.schema[c].dataType)}
    if wrong:
        raise TypeError(f"column(s) {wrong} do not hold numbers; expected numeric or boolean "
                        f"columns, arrays of numbers, or Spark ML vectors. "
                        f"{cast_hint(wrong.values())}")
    return names


def cast_hint(types: Iterable[str]) -> str:
    """How to make numbers of columns of these types (Spark's or Arrow's names)."""
    hint = ("Cast them first (F.col(name).cast('double'); a string label: "
            "pyspark.ml.feature.StringIndexer)")
    if any(t in ("binary", "large_binary") or t.startswith("fixed_size_binary") for t in types):
        hint += ("; bytes cannot be cast: store them as array<float> (e.g. "
                 "np.frombuffer(b, dtype=np.float32).tolist() in a UDF of return type "
                 "'array<float>')")
    return hint


def check_columns(df: DataFrame, columns: Columns) -> list[str]:
    """The columns to select; a ValueError naming any that ``df`` lacks, a TypeError for
    any that does not hold numbers."""
    return check_names(df, columns.names(), "features= (or inputs=) and label=")


def as_rows(data: RDD[object] | DataFrame, features: Spec | None = None, label: Label = "label",
            inputs: Inputs | None = None) -> RDD[Pair]:
    """An RDD of ``(features, label)`` numpy pairs from an RDD of pairs or a DataFrame.

    DataFrames are read by ``features=`` (one input) or ``inputs=`` (several) and ``label=``
    (one column, a list of columns assembled, or a tuple of those for several outputs).
    """
    return rows_of(data, Columns.of(features, label, inputs))


def rows_of(data: RDD[object] | DataFrame, columns: Columns) -> RDD[Pair]:
    """``as_rows`` with the columns already chosen (ignored for an RDD of pairs)."""
    if is_dataframe(data):
        get = row_extractor(columns)
        return data.select(*[spark_column(data, c).alias(c)
                             for c in check_columns(data, columns)]).rdd.map(get)
    if is_rdd(data):
        return data.map(row_pair)
    raise TypeError(f"data must be a pyspark RDD of (features, label) or a DataFrame; got "
                    f"{type(data).__name__}")
