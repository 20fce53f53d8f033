"""Minibatches streamed from a partition's chunks: a worker holds a bounded window, not its data.

``stream_batches`` reads a partition's chunks in their fixed order, groups consecutive chunks
into windows of at least ``window_rows`` rows, shuffles each window with a generator seeded by
(seed, epoch, rank, window) and cuts the resulting row sequence into minibatches. A worker
therefore holds one window (plus a chunk and a short remainder) at a time, whatever the size of
its partition, and a retried task sees the same minibatches. Windows before the wanted
minibatches are skipped without being copied (an averaging round starts mid-epoch).

``Spill`` keeps a partition on the executor's local disk for a task that reads it once per
epoch (the shared master trains every epoch in one task): chunks go to disk as ``.npz`` blobs
(no pickle) while they stream in, and come back one at a time.
"""

from __future__ import annotations

import os
import struct
import tempfile
from collections.abc import Iterable, Iterator
from types import TracebackType

import numpy as np

from paraloom.spark.data.arrays import concat, num_rows, take
from paraloom.spark.data.rows import Pair

__all__ = ["windows", "stream_batches", "Spill"]


def windows(chunks: Iterable[Pair], rows: int) -> Iterator[list[Pair]]:
    """Consecutive chunks grouped until a group holds ``rows`` rows or more (the last: fewer)."""
    group: list[Pair] = []
    held = 0
    for chunk in chunks:
        n = num_rows(chunk[0])
        if not n:
            continue
        group.append(chunk)
        held += n
        if held >= rows:
            yield group
            group, held = [], 0
    if group:
        yield group


def _join(group: list[Pair]) -> Pair:
    if len(group) == 1:
        return group[0]
    return concat([c[0] for c in group]), concat([c[1] for c in group])


def _slice(pair: Pair, lo: int, hi: int | None = None) -> Pair:
    idx = slice(lo, hi)
    return take(pair[0], idx), take(pair[1], idx)


def stream_batches(chunks: Iterable[Pair], batch_size: int, *, seed: int, epoch: int, rank: int,
                   window_rows: int, first: int = 0, count: int | None = None,
                   drop_last: bool = False) -> Iterator[Pair]:
    """Minibatches ``first .. first+count-1`` of this epoch's row sequence (all from ``first``
    when ``count`` is None), each a ``(features, labels)`` pair of arrays; the last may be short
    (``drop_last``: a short last one is left out, as a DataLoader's ``drop_last`` does).

    The sequence is the partition's rows window by window, each window shuffled by
    ``(seed, epoch, rank, window index)``; at most about ``window_rows + batch_size`` rows (plus
    one chunk) are held at once.
    """
    start = first * batch_size
    end = None if count is None else (first + count) * batch_size
    position = 0  # rows of the sequence before the current window
    pending: Pair | None = None  # rows cut off the previous window, fewer than a batch
    for w, group in enumerate(windows(chunks, window_rows)):
        n = sum(num_rows(c[0]) for c in group)
        if position + n <= start:
            position += n
            continue  # before the wanted minibatches: skipped without a copy
        if end is not None and position >= end:
            return
        order = np.random.default_rng([seed, epoch, rank, w]).permutation(n)
        window = _join(group)
        lo = max(start - position, 0)
        hi = n if end is None else min(n, end - position)
        window = (take(window[0], order[lo:hi]), take(window[1], order[lo:hi]))
        position += n
        if pending is not None:
            window = (concat([pending[0], window[0]]), concat([pending[1], window[1]]))
        have = num_rows(window[0])
        full = have - have % batch_size
        for at in range(0, full, batch_size):
            yield _slice(window, at, at + batch_size)
        pending = _slice(window, full) if full < have else None
    if pending is not None and not drop_last:
        yield pending


_LENGTH = struct.Struct("<Q")


class Spill:
    """A partition on local disk: ``write`` streams chunks in (yielding them on), ``chunks``
    reads them back one at a time. Use as a context manager; the file is deleted on exit."""

    def __init__(self, directory: str | None = None) -> None:
        if directory is None:  # Spark's scratch space on executors (where shuffles spill)
            directory = (os.environ.get("SPARK_LOCAL_DIRS") or "").split(",")[0] or None
        fd, self.path = tempfile.mkstemp(prefix="paraloom-partition-", suffix=".bin",
                                         dir=directory)
        os.close(fd)
        self.rows = 0
        self.chunks_written = 0

    def write(self, chunks: Iterable[Pair]) -> Iterator[Pair]:
        """Store every chunk of ``chunks`` on disk, yielding each on as it passes."""
        from paraloom.spark.data.arrow import encode_chunk

        with open(self.path, "ab") as f:
            for chunk in chunks:
                if not num_rows(chunk[0]):
                    continue
                blob = encode_chunk(chunk)
                f.write(_LENGTH.pack(len(blob)))
                f.write(blob)
                self.rows += num_rows(chunk[0])
                self.chunks_written += 1
                yield chunk

    def store(self, chunks: Iterable[Pair]) -> int:
        """Store every chunk of ``chunks``; returns the rows stored."""
        for _ in self.write(chunks):
            pass
        return self.rows

    def chunks(self) -> Iterator[Pair]:
        """The stored chunks, in the order they were written."""
        from paraloom.spark.data.arrow import decode_chunk

        with open(self.path, "rb") as f:
            while header := f.read(_LENGTH.size):
                (length,) = _LENGTH.unpack(header)
                yield decode_chunk(f.read(length))

    def close(self) -> None:
        """Delete the file."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def __enter__(self) -> Spill:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
