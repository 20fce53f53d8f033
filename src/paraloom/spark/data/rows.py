"""Rows in: RDD elements and DataFrame rows as ``(features, label)`` numpy pairs.

Every element a master trains on or evaluates comes from ``as_rows``; ``to_array`` accepts
numbers, lists, numpy arrays, tensors and Spark ML vectors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeGuard

import numpy as np
import torch

if TYPE_CHECKING:
    from pyspark import RDD
    from pyspark.sql import DataFrame, Row

__all__ = ["Pair", "to_array", "row_pair", "partition_arrays", "as_rows", "is_dataframe",
           "is_rdd"]

Pair = tuple[np.ndarray, np.ndarray]
"""One element, or a stack of them: (features, label) arrays."""


def to_array(value: Any) -> np.ndarray:
    """A feature or label value (number, list, numpy array, tensor, Spark ML vector) as numpy."""
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    to_numpy = getattr(value, "toArray", None)  # pyspark.ml.linalg DenseVector / SparseVector
    if to_numpy is not None:
        return np.asarray(to_numpy())
    return np.asarray(value)


def row_pair(row: Any) -> Pair:
    """One training element as ``(features, label)`` arrays."""
    if not isinstance(row, (tuple, list)) or len(row) != 2:
        raise TypeError(f"a training element must be a pair (features, label); got "
                        f"{type(row).__name__}. "
                        f"Map your RDD to (features, label) tuples, or pass a DataFrame with "
                        f"features= and label= column names")
    return to_array(row[0]), to_array(row[1])


def partition_arrays(pairs: Iterable[tuple[Any, Any]]) -> Pair:
    """Stack ``(features, label)`` rows into two arrays (empty arrays for no rows)."""
    xs, ys = [], []
    for x, y in pairs:
        xs.append(to_array(x))
        ys.append(to_array(y))
    if not xs:
        return np.zeros((0,), np.float32), np.zeros((0,), np.int64)
    try:
        return np.stack(xs), np.stack(ys)
    except ValueError as e:
        shapes = sorted({a.shape for a in xs})[:4]
        raise ValueError(f"feature rows have different shapes {shapes}: every row must have "
                         f"the same shape ({e})") from e


def is_dataframe(data: object) -> TypeGuard[DataFrame]:
    """True for a pyspark DataFrame (anything with ``rdd`` and ``columns``)."""
    return hasattr(data, "rdd") and hasattr(data, "columns")


def is_rdd(data: object) -> TypeGuard[RDD[Any]]:
    """True for a pyspark RDD (anything with ``mapPartitions``)."""
    return hasattr(data, "mapPartitions")


def _feature_extractor(features: str | Sequence[str]) -> Callable[[Row], np.ndarray]:
    if isinstance(features, str):
        return lambda row: to_array(row[features])
    cols = list(features)
    return lambda row: np.asarray([row[c] for c in cols])


def as_rows(data: RDD[Any] | DataFrame, features: str | Sequence[str] = "features",
            label: str = "label") -> RDD[Pair]:
    """An RDD of ``(features, label)`` numpy pairs from an RDD of pairs or a DataFrame."""
    if is_dataframe(data):
        names = [features] if isinstance(features, str) else list(features)
        missing = [c for c in [*names, label] if c not in data.columns]
        if missing:
            raise ValueError(f"the DataFrame has no column(s) {missing}; its columns are "
                             f"{data.columns}. Pass features= and label= column names")
        get = _feature_extractor(features)
        return data.select(*names, label).rdd.map(lambda row: (get(row), to_array(row[label])))
    if is_rdd(data):
        return data.map(row_pair)
    raise TypeError(f"data must be a pyspark RDD of (features, label) or a DataFrame; got "
                    f"{type(data).__name__}")
