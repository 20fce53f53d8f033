"""Deterministic, balanced partitions of training rows, stacked into array chunks.

``partition_chunks`` spreads the rows over ``workers`` partitions with a fixed rule and sorts
each partition by the rows' origin, so a re-run stage attempt (or the next averaging round)
sees the same rows in the same order; rows are stacked into chunks so that reading a partition
costs a few large array copies rather than one unpickle per row. The sort is Spark's
(``repartitionAndSortWithinPartitions``, which spills to disk past
``spark.python.worker.memory``): no step holds a whole partition in an executor's Python
process.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from paraloom.spark.data.arrays import concat, num_rows, take
from paraloom.spark.data.rows import Pair, partition_arrays

if TYPE_CHECKING:
    from pyspark import RDD

__all__ = ["Chunk", "chunk_rows", "first_worker", "join_chunks", "partition_chunks",
           "spread_chunks"]

_CHUNK_ROWS = 1024

Chunk = Pair
"""Consecutive rows of one partition, stacked: (features, labels) arrays (or tuples of them)."""

_Key = tuple[int, int]
"""Where a row came from: (source partition, position in it)."""


def chunk_rows(keyed: Iterable[tuple[_Key, Pair]], size: int = _CHUNK_ROWS) -> Iterator[Chunk]:
    """Stack consecutive ``(key, (features, label))`` rows, in the order given, into chunks of
    ``size`` rows (one chunk's rows held at a time)."""
    block: list[Pair] = []
    for _, pair in keyed:
        block.append(pair)
        if len(block) == size:
            yield partition_arrays(block)
            block = []
    if block:
        yield partition_arrays(block)


def join_chunks(chunks: Iterable[Chunk]) -> Chunk:
    """Concatenate chunks into one (features, labels) pair of arrays (tests, small data)."""
    parts = [c for c in chunks if num_rows(c[0])]
    if not parts:
        return np.zeros((0,), np.float32), np.zeros((0,), np.int64)
    return concat([c[0] for c in parts]), concat([c[1] for c in parts])


def _keyed(index: int, rows: Iterable[Pair]) -> Iterator[tuple[_Key, Pair]]:  # or chunks
    for position, row in enumerate(rows):
        yield (index, position), row


def first_worker(index: int, workers: int) -> int:
    """The worker that source partition ``index``'s first row goes to: ``index`` times the
    golden ratio, its fraction scaled to ``workers`` (in 64-bit fixed point: the same on every
    machine). Any start keeps each partition's share equal to one row; these spread the
    starts evenly over the workers for any pattern of indices, so that many partitions of a
    row or none (``sc.parallelize(rows, 2 * len(rows))`` fills every other one) do not all
    start at one worker, as ``index % workers`` did: [0, 40] for 40 rows in 80 slices."""
    return (((index * _GOLDEN) & _MASK) * workers) >> 64


_GOLDEN, _MASK = 0x9E3779B97F4A7C15, (1 << 64) - 1


def _target(workers: int) -> Callable[[_Key], int]:
    return lambda key: (first_worker(key[0], workers) + key[1]) % workers


def _spread(rdd: RDD[Pair], workers: int, repartition: str,
            finish: Callable[[Iterable[tuple[Any, Pair]]], Iterator[Chunk]],
            cut: Callable[[int, Iterable[Pair]], Iterator[tuple[Any, Pair]]] = _keyed,
            target: Callable[[Any], int] | None = None) -> RDD[Chunk]:
    """Element ``j`` of source partition ``i`` to partition ``(first_worker(i) + j) % workers``,
    each partition sorted by origin; then ``finish`` turns its keyed elements into chunks.
    ``cut`` keys a partition's elements for the shuffle and ``target`` names a key's partition
    (a chunk's pieces: ``spread_chunks``); kept partitions are keyed by ``_keyed``, whole."""
    have = rdd.getNumPartitions()
    if repartition == "if_needed":
        repartition = "never" if have == workers and not _coalesced(rdd) else "always"
    if repartition == "never":
        if have != workers:
            raise ValueError(f"repartition='never' but the data has {have} partitions and "
                             f"workers={workers}; use repartition='always' or 'if_needed', or "
                             f"repartition the data to {workers} partitions")
        if _coalesced(rdd):
            raise ValueError("repartition='never' but the data's partitions come from "
                             "coalesce() or union(), which Spark's barrier stage cannot run "
                             f"(SPARK-24820): use repartition({workers}) instead of "
                             f"coalesce({workers}), or repartition='if_needed'")
        return rdd.mapPartitionsWithIndex(_keyed).mapPartitions(  # already in order
            finish, preservesPartitioning=True)
    spread = rdd.mapPartitionsWithIndex(cut).repartitionAndSortWithinPartitions(
        workers, target or _target(workers))
    return spread.mapPartitions(finish, preservesPartitioning=True)


_UNBARRIERED = ("CoalescedRDD", "UnionRDD", "PartitionPruningRDD")
"""RDDs whose partitions are not their parents': Spark runs no barrier stage over one in the
stage (SPARK-24820, BarrierJobUnsupportedRDDChainException): a coalesce() or a union()."""


def _coalesced(rdd: RDD[Any]) -> bool:
    """Whether ``rdd`` reads a coalesce() or union() (DataFrame or RDD) without a shuffle
    since, from its lineage (each RDD named, the newest first)."""
    lineage = rdd.toDebugString() or b""
    text = lineage.decode() if isinstance(lineage, bytes) else str(lineage)
    stage = re.split(r"Shuffled\w*RDD", text, maxsplit=1)[0]
    return any(name in stage for name in _UNBARRIERED)


def partition_chunks(rows: RDD[Pair], workers: int, repartition: str = "always") -> RDD[Chunk]:
    """``rows`` spread over ``workers`` partitions, deterministically, as sorted array chunks.

    Row ``j`` of source partition ``i`` goes to partition ``(first_worker(i) + j) % workers``:
    balanced to one row per source partition. ``repartition="never"`` keeps the existing
    partitions (there must be exactly ``workers``); ``"if_needed"`` repartitions only when the
    count differs.
    """
    return _spread(rows, workers, repartition, chunk_rows)


def _values(keyed: Iterable[tuple[object, Chunk]]) -> Iterator[Chunk]:
    for _, chunk in keyed:
        yield chunk


_PieceKey = tuple[int, int, int]
"""A piece of a chunk: (source partition, its first row's position there, target worker)."""


def _pieces(workers: int) -> Callable[[int, Iterable[Chunk]], Iterator[tuple[_PieceKey, Chunk]]]:
    """Each chunk of source partition ``i`` cut into (at most) ``workers`` strided pieces: the
    piece for worker ``w`` holds the chunk's rows ``j`` (positions in the partition) with
    ``(first_worker(i) + j) % workers == w``, as ``partition_chunks`` deals single rows."""
    def cut(index: int, chunks: Iterable[Chunk]) -> Iterator[tuple[_PieceKey, Chunk]]:
        position, start = 0, first_worker(index, workers)
        for features, labels in chunks:
            n = num_rows(features)
            for w in range(workers):
                first = (w - start - position) % workers
                if first < n:
                    rows = slice(first, None, workers)
                    yield (index, position, w), (take(features, rows), take(labels, rows))
            position += n
    return cut


def spread_chunks(chunks: RDD[Chunk], workers: int, repartition: str = "always") -> RDD[Chunk]:
    """Already-stacked chunks spread over ``workers`` partitions, deterministically.

    ``partition_chunks`` for chunk RDDs (Arrow-decoded DataFrames and Parquet paths), with the
    same rule: row ``j`` of source partition ``i`` goes to partition ``(first_worker(i) + j) %
    workers``, so the shares are balanced to one row per source partition (whole chunks dealt
    round robin left a partition smaller than a chunk on one worker: [200, 0] for 200 rows in
    one partition). A chunk is cut into one strided slice per worker, never re-pickled row by
    row; each partition is sorted by origin. ``repartition="never"`` keeps the chunks where they
    are (there must be ``workers`` partitions).
    """
    return _spread(chunks, workers, repartition, _values, cut=_pieces(workers),
                   target=lambda key: key[2])
