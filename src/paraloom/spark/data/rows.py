"""Training data on Spark: rows in, deterministic balanced partitions of array chunks out.

Every element a master trains on comes from ``as_rows`` as ``(features, label)`` numpy pairs.
``partition_chunks`` spreads them over ``workers`` partitions with a fixed rule and sorts each
partition by the rows' origin, so a re-run stage attempt (or the next averaging round) sees
the same rows in the same order; rows are stacked into chunks so that reading a partition
costs a few large array copies rather than one unpickle per row.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["Features", "to_array", "row_pair", "partition_arrays", "chunk_rows", "epoch_order",
           "batch_count", "round_batches", "as_rows", "partition_chunks"]

_CHUNK_ROWS = 1024


@dataclass(frozen=True)
class Features:
    """How stacked numpy rows become tensors: feature shape and dtypes."""

    shape: tuple[int, ...] | None = None
    """Per-row shape the model expects (e.g. (1, 8, 8)); None keeps the rows' own shape."""
    dtype: str = "float32"
    label_dtype: str | None = None
    """None: integer labels become int64, floating ones ``dtype``."""

    def features(self, x: np.ndarray) -> torch.Tensor:
        """A batch of feature rows as a tensor of the model's dtype and input shape."""
        t = torch.from_numpy(np.ascontiguousarray(x)).to(getattr(torch, self.dtype))
        if self.shape is not None:
            per_row = int(np.prod(self.shape))
            if len(t) and t[0].numel() != per_row:
                raise ValueError(f"a feature row has {t[0].numel()} values but feature_shape="
                                 f"{self.shape} needs {per_row}; fix feature_shape")
            t = t.reshape(len(t), *self.shape)
        return t

    def labels(self, y: np.ndarray) -> torch.Tensor:
        """A batch of labels: int64 for integers (class indices), else the feature dtype."""
        t = torch.from_numpy(np.ascontiguousarray(y))
        if self.label_dtype is not None:
            return t.to(getattr(torch, self.label_dtype))
        if t.dtype.is_floating_point:
            return t.to(getattr(torch, self.dtype))
        if t.dtype == torch.bool:
            return t.long()
        return t.to(torch.int64)


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


def row_pair(row: Any) -> tuple[np.ndarray, np.ndarray]:
    """One training element as ``(features, label)`` arrays."""
    if not isinstance(row, (tuple, list)) or len(row) != 2:
        raise TypeError(f"a training element must be a pair (features, label); got "
                        f"{type(row).__name__}. "
                        f"Map your RDD to (features, label) tuples, or pass a DataFrame with "
                        f"features= and label= column names")
    return to_array(row[0]), to_array(row[1])


def partition_arrays(pairs: Iterable[tuple[Any, Any]]) -> tuple[np.ndarray, np.ndarray]:
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


def chunk_rows(keyed: Iterable[tuple[Any, tuple[Any, Any]]],
               size: int = _CHUNK_ROWS) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Sort ``(key, (features, label))`` by key and stack consecutive rows into chunks."""
    rows = sorted(keyed, key=lambda kv: kv[0])
    for start in range(0, len(rows), size):
        yield partition_arrays(pair for _, pair in rows[start:start + size])


def join_chunks(chunks: Iterable[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate a partition's chunks back into one (features, labels) pair of arrays."""
    parts = [c for c in chunks if len(c[0])]
    if not parts:
        return np.zeros((0,), np.float32), np.zeros((0,), np.int64)
    return np.concatenate([c[0] for c in parts]), np.concatenate([c[1] for c in parts])


def epoch_order(n: int, seed: int, epoch: int, rank: int) -> np.ndarray:
    """This rank's row order in ``epoch``: fixed by (seed, epoch, rank), so retries repeat it."""
    return np.random.default_rng([seed, epoch, rank]).permutation(n)


def batch_count(n: int, batch_size: int) -> int:
    """Minibatches in ``n`` rows (the last one may be short)."""
    return -(-n // batch_size)


def round_batches(order: np.ndarray, batch_size: int, first: int, count: int) -> list[np.ndarray]:
    """Row indices of minibatches ``first .. first+count-1`` (fewer at the end of the rows)."""
    out = []
    for b in range(first, first + count):
        idx = order[b * batch_size:(b + 1) * batch_size]
        if not len(idx):
            break
        out.append(idx)
    return out


def _feature_extractor(features: str | Sequence[str]) -> Any:
    if isinstance(features, str):
        return lambda row: to_array(row[features])
    cols = list(features)
    return lambda row: np.asarray([row[c] for c in cols])


def as_rows(data: Any, features: str | Sequence[str] = "features", label: str = "label") -> Any:
    """An RDD of ``(features, label)`` numpy pairs from an RDD of pairs or a DataFrame."""
    if hasattr(data, "rdd") and hasattr(data, "columns"):  # a pyspark DataFrame
        names = [features] if isinstance(features, str) else list(features)
        missing = [c for c in [*names, label] if c not in data.columns]
        if missing:
            raise ValueError(f"the DataFrame has no column(s) {missing}; its columns are "
                             f"{data.columns}. Pass features= and label= column names")
        get = _feature_extractor(features)
        return data.select(*names, label).rdd.map(lambda row: (get(row), to_array(row[label])))
    if hasattr(data, "mapPartitions"):
        return data.map(row_pair)
    raise TypeError(f"data must be a pyspark RDD of (features, label) or a DataFrame; got "
                    f"{type(data).__name__}")


def _keyed(index: int, rows: Iterator[Any]) -> Iterator[tuple[tuple[int, int], Any]]:
    for position, row in enumerate(rows):
        yield (index, position), row


def partition_chunks(rows: Any, workers: int, repartition: str = "always") -> Any:
    """``rows`` spread over ``workers`` partitions, deterministically, as sorted array chunks.

    Row ``j`` of source partition ``i`` goes to partition ``(i + j) % workers``: balanced to
    one row per source partition. ``repartition="never"`` keeps the existing partitions (there
    must be exactly ``workers``); ``"if_needed"`` repartitions only when the count differs.
    """
    have = rows.getNumPartitions()
    if repartition == "if_needed":
        repartition = "never" if have == workers else "always"
    keyed = rows.mapPartitionsWithIndex(_keyed)
    if repartition == "never":
        if have != workers:
            raise ValueError(f"repartition='never' but the data has {have} partitions and "
                             f"workers={workers}; use repartition='always' or 'if_needed', or "
                             f"repartition the data to {workers} partitions")
        return keyed.mapPartitions(chunk_rows, preservesPartitioning=True)
    spread = keyed.partitionBy(workers, lambda key: key[0] + key[1])
    return spread.mapPartitions(chunk_rows, preservesPartitioning=True)
