"""DataFrames (and Parquet paths) to array chunks through Arrow record batches, on the executors.

``arrow_chunks`` runs ``DataFrame.mapInArrow`` over the selected columns: each Arrow record
batch becomes numpy arrays column by column (no per-row Python objects), cut into chunks of at
most ``rows`` rows, each sent on as one ``.npz`` blob (no pickle). The driver never sees the
data; an executor holds one record batch and one chunk at a time while decoding.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from paraloom.spark.data.rows import Columns, Pair, Spec, check_columns

if TYPE_CHECKING:
    import pyarrow as pa  # type: ignore[import-untyped]
    from pyspark import RDD
    from pyspark.sql import DataFrame

__all__ = ["arrow_column", "batch_pair", "encode_chunk", "decode_chunk", "arrow_chunks"]

CHUNK_ROWS = 256


def arrow_column(arr: pa.Array | pa.ChunkedArray, name: str) -> np.ndarray:
    """One Arrow column as a numpy array: numbers (n,), lists of equal length (n, k, ...)."""
    import pyarrow as pa

    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if arr.null_count:
        raise ValueError(f"column {name!r} has {arr.null_count} null value(s); drop or fill them "
                         f"first (df.na.drop() / df.na.fill())")
    kind = arr.type
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or \
            pa.types.is_fixed_size_list(kind):
        lengths = np.unique(np.asarray(arr.value_lengths()))
        if len(lengths) > 1:
            raise ValueError(f"column {name!r} holds arrays of different lengths "
                             f"{lengths[:4].tolist()}: every row must have the same shape")
        inner = arrow_column(arr.flatten(), name)
        return inner.reshape(len(arr), -1, *inner.shape[1:]) if len(arr) else \
            inner.reshape(0, *([int(lengths[0])] if len(lengths) else [0]), *inner.shape[1:])
    if pa.types.is_struct(kind):
        raise TypeError(f"column {name!r} is a struct (a Spark ML vector?); store arrays: "
                        f"df.withColumn({name!r}, pyspark.ml.functions.vector_to_array("
                        f"{name!r}))")
    if pa.types.is_boolean(kind):
        return np.asarray(arr.to_numpy(zero_copy_only=False), dtype=np.int64)
    if not (pa.types.is_integer(kind) or pa.types.is_floating(kind)):
        raise TypeError(f"column {name!r} has type {kind}; expected numbers or arrays of numbers")
    return arr.to_numpy(zero_copy_only=False)


def _spec(batch: pa.RecordBatch, spec: Spec) -> np.ndarray:
    if isinstance(spec, str):
        return arrow_column(batch.column(spec), spec)
    parts = [arrow_column(batch.column(c), c).reshape(batch.num_rows, -1) for c in spec]
    return np.concatenate(parts, axis=1)


def _field(batch: pa.RecordBatch, field: Any) -> Any:
    if isinstance(field, tuple):
        return tuple(_spec(batch, s) for s in field)
    if isinstance(field, dict):
        return {k: _spec(batch, s) for k, s in field.items()}
    return _spec(batch, field)


def batch_pair(batch: pa.RecordBatch, columns: Columns) -> Pair:
    """A record batch's ``(features, label)`` arrays (tuples / dicts of them for several)."""
    return _field(batch, columns.features), _field(batch, columns.label)


def _flat(prefix: str, a: Any) -> dict[str, np.ndarray]:
    if isinstance(a, tuple):
        return {f"{prefix}#{i}": v for i, v in enumerate(a)}
    if isinstance(a, dict):
        return {f"{prefix}@{k}": v for k, v in a.items()}
    return {prefix: a}


def encode_chunk(pair: Pair) -> bytes:
    """A chunk as ``.npz`` bytes (arrays only: decoding unpickles nothing)."""
    out = io.BytesIO()
    arrays: dict[str, Any] = {**_flat("x", pair[0]), **_flat("y", pair[1])}
    np.savez(out, **arrays)
    return out.getvalue()


def _unflat(prefix: str, arrays: dict[str, np.ndarray]) -> Any:
    if prefix in arrays:
        return arrays[prefix]
    items = [(k[len(prefix):], v) for k, v in arrays.items() if k.startswith(prefix)]
    if items and items[0][0].startswith("#"):
        return tuple(v for _, v in sorted(items, key=lambda kv: int(kv[0][1:])))
    return {k[1:]: v for k, v in items}


def decode_chunk(blob: bytes) -> Pair:
    """``encode_chunk``'s arrays back as ``(features, label)``."""
    with np.load(io.BytesIO(blob), allow_pickle=False) as data:
        arrays = {k: data[k] for k in data.files}
    return _unflat("x", arrays), _unflat("y", arrays)


def arrow_chunks(df: DataFrame, columns: Columns, rows: int = CHUNK_ROWS) -> RDD[Pair]:
    """``df``'s rows as an RDD of chunks (stacked ``(features, label)`` arrays), per partition.

    Decoded on the executors from Arrow record batches; partitions keep their rows' order.
    """
    import pyarrow as pa

    names = check_columns(df, columns)

    def decode(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            for start in range(0, batch.num_rows, rows):
                part = batch.slice(start, rows)
                yield pa.RecordBatch.from_pydict(
                    {"chunk": pa.array([encode_chunk(batch_pair(part, columns))],
                                       pa.binary())})

    encoded = df.select(*names).mapInArrow(decode, "chunk binary")
    return encoded.rdd.map(lambda row: decode_chunk(row[0]))
