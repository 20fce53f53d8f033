"""DataFrames (and Parquet paths) to array chunks through Arrow record batches, on the executors.

``arrow_chunks`` runs ``DataFrame.mapInArrow`` over the selected columns: each Arrow record
batch becomes numpy arrays column by column (no per-row Python objects), cut into chunks of at
most ``rows`` rows, each sent on as one ``.npz`` blob (no pickle). The driver never sees the
data; an executor holds one record batch and one chunk at a time while decoding.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from paraloom.spark.data.arrays import Arrays
from paraloom.spark.data.rows import (
    Columns,
    FieldSpec,
    Pair,
    Spec,
    check_columns,
    column,
    spark_column,
    whole_decimal,
)

if TYPE_CHECKING:
    import pyarrow as pa  # type: ignore[import-untyped]
    from pyspark import RDD
    from pyspark.sql import Column, DataFrame

__all__ = ["arrow_column", "arrow_field", "batch_pair", "decodable", "encode_chunk",
           "decode_chunk", "arrow_chunks", "arrow_columns", "check_prebatched", "data_chunks",
           "is_list_type", "is_ml_vector", "unbatch"]

CHUNK_ROWS = 256


def arrow_column(arr: pa.Array | pa.ChunkedArray, name: str, *, inner: bool = False
                 ) -> np.ndarray:
    """One Arrow column as a numpy array: numbers (n,), lists of equal length (n, k, ...)
    (``inner``: ``arr`` is the elements of ``name``'s arrays)."""
    import pyarrow as pa

    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if arr.null_count and inner:  # df.na.drop() and fill() do not look inside arrays
        raise ValueError(
            f"column {name!r} has {arr.null_count} null element(s) inside its arrays, which "
            f"df.na.drop() and df.na.fill() leave in; drop those rows first (df.filter(~F."
            f"exists({name!r}, lambda v: v.isNull())), F from pyspark.sql.functions) or fill "
            f"them (df.withColumn({name!r}, F.transform({name!r}, lambda v: F.coalesce(v, "
            "F.lit(0.0)))))")
    if arr.null_count:
        raise ValueError(f"column {name!r} has {arr.null_count} null value(s); drop or fill them "
                         f"first (df.na.drop() / df.na.fill())")
    kind = arr.type
    if is_list_type(kind):
        lengths = np.unique(np.asarray(arr.value_lengths()))
        if len(lengths) > 1:
            raise ValueError(f"column {name!r} holds arrays of different lengths "
                             f"{lengths[:4].tolist()}: every row must have the same shape")
        values = arrow_column(arr.flatten(), name, inner=True)
        return values.reshape(len(arr), -1, *values.shape[1:]) if len(arr) else \
            values.reshape(0, *([int(lengths[0])] if len(lengths) else [0]), *values.shape[1:])
    if pa.types.is_struct(kind):
        if is_ml_vector(kind):
            return ml_vectors(arr, name)
        raise TypeError(f"column {name!r} is a struct ({kind}); expected numbers or arrays of "
                        f"numbers (or Spark ML vectors)")
    if pa.types.is_boolean(kind):
        return np.asarray(arr.to_numpy(zero_copy_only=False), dtype=np.int64)
    if pa.types.is_decimal(kind):  # a Parquet file's exact decimals, read as Spark's are
        whole = whole_decimal(kind.precision, kind.scale)
        return np.asarray(arr.cast(pa.int64() if whole else pa.float64())
                          .to_numpy(zero_copy_only=False))
    if not (pa.types.is_integer(kind) or pa.types.is_floating(kind)):
        raise TypeError(f"column {name!r} has type {kind}; expected numbers or arrays of numbers")
    return np.asarray(arr.to_numpy(zero_copy_only=False))


_VECTOR_FIELDS = ("type", "size", "indices", "values")


def is_list_type(kind: pa.DataType) -> bool:
    """Whether an Arrow type is a list (of any length kind: list, large list, fixed size)."""
    import pyarrow as pa

    return bool(pa.types.is_list(kind) or pa.types.is_large_list(kind)
                or pa.types.is_fixed_size_list(kind))


def decodable(kind: pa.DataType) -> bool:
    """Whether ``arrow_column`` decodes a column of this type: numbers (decimals too),
    booleans, (nested) lists of them, or Spark ML vectors."""
    import pyarrow as pa

    if pa.types.is_struct(kind):
        return is_ml_vector(kind)
    while is_list_type(kind):
        kind = kind.value_type
    return bool(pa.types.is_integer(kind) or pa.types.is_floating(kind)
                or pa.types.is_boolean(kind) or pa.types.is_decimal(kind))


def is_ml_vector(kind: pa.DataType) -> bool:
    """Whether an Arrow type is how Spark stores an ML vector (``VectorUDT``) in Parquet."""
    return [kind.field(i).name for i in range(kind.num_fields)] == list(_VECTOR_FIELDS)


def ml_vectors(arr: pa.StructArray, name: str) -> np.ndarray:
    """Spark ML vectors (dense or sparse, Spark's Parquet struct) as a dense (n, size) array
    of doubles."""
    kinds, sizes, indices, values = arr.flatten()  # the children, the slice's rows only
    kind = np.asarray(kinds.to_numpy(zero_copy_only=False))
    if (kind == 1).all():  # all dense: the values are the rows
        return arrow_column(values, name).astype(np.float64, copy=False)
    width = max(int(np.asarray(sizes.fill_null(0).to_numpy(zero_copy_only=False)).max()),
                int(np.asarray(values.value_lengths().fill_null(0)).max()))
    out = np.zeros((len(arr), width), np.float64)
    lengths = np.asarray(values.value_lengths().fill_null(0).to_numpy(zero_copy_only=False))
    flat = np.asarray(values.flatten().to_numpy(zero_copy_only=False))
    rows = np.repeat(np.arange(len(arr)), lengths)
    dense = np.repeat(kind == 1, lengths)
    at = np.arange(len(flat)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    out[rows[dense], at[dense]] = flat[dense]
    sparse = ~dense
    if sparse.any():
        columns = np.asarray(indices.flatten().to_numpy(zero_copy_only=False))
        out[rows[sparse], columns] = flat[sparse]
    return out


def _spec(get: Callable[[str], pa.Array], rows: int, spec: Spec) -> np.ndarray:
    if isinstance(spec, str):
        return arrow_column(get(spec), spec)
    parts = [arrow_column(get(c), c).reshape(rows, -1) for c in spec]
    return np.concatenate(parts, axis=1)


def arrow_field(get: Callable[[str], pa.Array], rows: int, field: FieldSpec) -> Arrays:
    """One field (a spec, a tuple or a dict of specs) of ``rows`` rows as numpy array(s), each
    column read with ``get(name)``: the one decoding path of training, evaluation and
    prediction."""
    if isinstance(field, tuple):
        return tuple(_spec(get, rows, s) for s in field)
    if isinstance(field, dict):
        return {k: _spec(get, rows, s) for k, s in field.items()}
    return _spec(get, rows, field)


def batch_pair(batch: pa.RecordBatch, columns: Columns) -> Pair:
    """A record batch's ``(features, label)`` arrays (tuples / dicts of them for several)."""
    return (arrow_field(batch.column, batch.num_rows, columns.features),
            arrow_field(batch.column, batch.num_rows, columns.label))


def _flat(prefix: str, a: Arrays) -> dict[str, np.ndarray]:
    if isinstance(a, tuple):
        return {f"{prefix}#{i}": v for i, v in enumerate(a)}
    if isinstance(a, dict):
        return {f"{prefix}@{k}": v for k, v in a.items()}
    return {prefix: a}


def encode_chunk(pair: Pair) -> bytes:
    """A chunk as ``.npz`` bytes (arrays only: decoding unpickles nothing)."""
    out = io.BytesIO()
    # Any: savez's stub gives its arrays-by-keyword the type of its own allow_pickle flag
    arrays: dict[str, Any] = {**_flat("x", pair[0]), **_flat("y", pair[1])}
    np.savez(out, **arrays)
    return out.getvalue()


def _unflat(prefix: str, arrays: dict[str, np.ndarray]) -> Arrays:
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


def arrow_columns(df: DataFrame, names: list[str]) -> list[Column]:
    """``df``'s columns ``names`` ready for Arrow: Spark ML vectors as arrays of doubles,
    decimals as doubles."""
    from pyspark.ml.functions import vector_to_array

    return [vector_to_array(column(n)).alias(n)
            if type(df.schema[n].dataType).__name__ == "VectorUDT" else spark_column(df, n).alias(n)
            for n in names]


def unbatch(cols: dict[str, pa.Array]) -> tuple[dict[str, pa.Array], np.ndarray]:
    """Pre-batched columns (each cell a list with one entry per example) flattened to one
    entry per example, and the examples per row; every column of a row must hold the same
    count."""

    flat: dict[str, pa.Array] = {}
    counts = None
    first = next(iter(cols), "")
    for name, arr in cols.items():
        kind = arr.type
        if not is_list_type(kind):
            raise TypeError(f"prebatched=True but column {name!r} holds {kind}, no list per "
                            f"row; a pre-batched row holds one entry per example in every "
                            f"column (features [n, ...], label [n])")
        if arr.null_count:
            raise ValueError(f"column {name!r} has {arr.null_count} null row(s); drop them "
                             f"first (df.na.drop())")
        lengths = np.asarray(arr.value_lengths(), dtype=np.int64)
        if counts is None:
            counts = lengths
        elif not np.array_equal(lengths, counts):
            raise ValueError(f"prebatched=True but column {name!r} holds "
                             f"{lengths.tolist()[:4]} examples per row where {first!r} holds "
                             f"{counts.tolist()[:4]}: every column of a row needs the same "
                             f"count")
        flat[name] = arr.flatten()
    return flat, counts if counts is not None else np.zeros(0, np.int64)


def unbatched_pair(batch: pa.RecordBatch, columns: Columns, names: list[str]) -> Pair:
    """Pre-batched rows as the examples' ``(features, label)`` arrays: the outer list level
    of every column is flattened (``unbatch``)."""
    flat, counts = unbatch({name: batch.column(name) for name in names})
    total = int(counts.sum())
    return (arrow_field(flat.__getitem__, total, columns.features),
            arrow_field(flat.__getitem__, total, columns.label))


def check_prebatched(df: DataFrame, names: list[str]) -> None:
    """On the driver: with ``prebatched=True`` every column must hold a list per row."""
    from pyspark.sql.types import ArrayType

    flat = {n: df.schema[n].dataType.simpleString() for n in names
            if not isinstance(df.schema[n].dataType, ArrayType)}
    if flat:
        raise TypeError(f"prebatched=True but column(s) {flat} hold no list per row; a "
                        f"pre-batched row holds one entry per example in every column "
                        f"(features [n, ...], label [n])")


def arrow_chunks(df: DataFrame, columns: Columns, rows: int = CHUNK_ROWS,
                 prebatched: bool = False) -> RDD[Pair]:
    """``df``'s rows as an RDD of chunks (stacked ``(features, label)`` arrays), per partition.

    Decoded on the executors from Arrow record batches; partitions keep their rows' order.
    ``prebatched``: each row holds a whole minibatch (DL4J's examplesPerDataSetObject) and
    becomes one chunk.
    """
    import pyarrow as pa

    names = check_columns(df, columns)
    if prebatched:
        check_prebatched(df, names)

    def decode(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        try:
            for arrow_batch in batches:  # the columns' own names back (no copy)
                batch = pa.RecordBatch.from_arrays(arrow_batch.columns, names=names)
                if prebatched:  # every row a minibatch: one chunk per row
                    parts = (unbatched_pair(batch.slice(i, 1), columns, names)
                             for i in range(batch.num_rows))
                else:
                    parts = (batch_pair(batch.slice(start, rows), columns)
                             for start in range(0, batch.num_rows, rows))
                for pair in parts:
                    yield pa.RecordBatch.from_pydict(
                        {"chunk": pa.array([encode_chunk(pair)], pa.binary()),
                         "error": pa.array([None], pa.string())})
        except (ValueError, TypeError) as e:
            # Bad data (nulls, ragged arrays): raised where the chunks are read, in Python, so
            # that a barrier task reports it as its error. Raised here, it would fail the JVM
            # side of the task, and Spark would re-run the whole stage for it.
            yield pa.RecordBatch.from_pydict({"chunk": pa.array([b""], pa.binary()),
                                              "error": pa.array([str(e)], pa.string())})

    # mapInArrow resolves every column by name, reading a dot as a struct field: the columns
    # travel as _0, _1, ... so that names like "sepal.length" work
    selected = [c.alias(f"_{i}") for i, c in enumerate(arrow_columns(df, names))]
    encoded = df.select(*selected).mapInArrow(decode, "chunk binary, error string")
    return encoded.rdd.map(_chunk_of_row)


def _chunk_of_row(row: Any) -> Pair:
    """A chunk from ``arrow_chunks``' rows: its arrays, or the data's error raised again."""
    if row[1] is not None:
        raise ValueError(row[1])
    return decode_chunk(row[0])


def _stacked(size: int) -> Callable[[Iterable[Pair]], Iterator[Pair]]:
    from paraloom.spark.data.partitions import chunk_rows

    return lambda rows: chunk_rows((((0, 0), row) for row in rows), size)


def data_chunks(data: RDD[object] | DataFrame, columns: Columns, rows: int = CHUNK_ROWS,
                prebatched: bool = False) -> RDD[Pair]:
    """Chunks of at most ``rows`` stacked ``(features, label)`` rows from a DataFrame (decoded
    from Arrow batches on the executors) or an RDD of ``(features, label)`` pairs.

    ``prebatched``: every row (element) already holds a minibatch, which is one chunk.
    """
    from paraloom.spark.data.rows import is_dataframe, rows_of

    if is_dataframe(data):
        return arrow_chunks(data, columns, rows, prebatched)
    pairs = rows_of(data, columns)
    return pairs.map(_checked_batch) if prebatched else pairs.mapPartitions(_stacked(rows))


def _checked_batch(pair: Pair) -> Pair:
    from paraloom.spark.data.arrays import leaves

    counts = {len(a) if np.ndim(a) else -1 for a in leaves(pair[0]) + leaves(pair[1])}
    if len(counts) != 1 or -1 in counts:
        raise ValueError(f"prebatched=True but an element's arrays hold {sorted(counts)} "
                         f"examples: each element must be (features [n, ...], labels [n]), "
                         f"every array with the same n")
    return pair
