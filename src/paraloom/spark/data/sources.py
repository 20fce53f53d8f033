"""Where a barrier task's training rows come from, epoch after epoch (``TaskData``).

``StreamedPartition``: the task's partition of an RDD or DataFrame, trained on as it arrives
from Spark in the first epoch and stored on the executor's local disk on the way, then read
back from there in every later epoch. ``ParquetShare``: the task's share of a Parquet set
(``ParquetSet.share``), read from the files every epoch with nothing stored.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Protocol

from paraloom.spark.data.parquet import ParquetSet, prefetched, read_share
from paraloom.spark.data.rows import Columns, Pair
from paraloom.spark.data.stream import Spill

__all__ = ["TaskData", "StreamedPartition", "ParquetShare"]


class TaskData(Protocol):
    """A task's training rows: the same rows every epoch, read as chunks in a fixed order."""

    @property
    def rows(self) -> int | None:
        """How many rows; None while that is not known yet (a partition still streaming in)."""
        ...

    def chunks(self, epoch: int) -> Iterable[Pair]:
        """This epoch's rows as ``(features, label)`` chunks, in the epoch's order."""
        ...

    def close(self) -> None: ...


class StreamedPartition:
    """A partition's chunks, in arrival order: read from ``source`` the first time (each chunk
    written to local disk as it passes on), from the disk after that.

    ``rows`` is None until the source has been read to its end. Nothing is read on creation,
    so the first epoch's first minibatch trains as soon as its rows arrive.
    """

    def __init__(self, source: Iterable[Pair], directory: str | None = None) -> None:
        self._source: Iterator[Pair] = iter(source)
        self._spill = Spill(directory)
        self._state = "unread"  # -> "reading" -> "stored"

    @property
    def rows(self) -> int | None:
        return self._spill.rows if self._state == "stored" else None

    def chunks(self, epoch: int) -> Iterator[Pair]:
        if self._state == "unread":
            self._state = "reading"
            return self._read_through()
        if self._state == "reading":  # an earlier pass stopped early: store what it left
            self._spill.store(self._source)
            self._state = "stored"
        return self._spill.chunks()

    def _read_through(self) -> Iterator[Pair]:
        yield from self._spill.write(self._source)
        self._state = "stored"

    def close(self) -> None:
        self._spill.close()


class ParquetShare:
    """Rank ``rank`` of ``world``'s share of ``data``, read from the files every epoch on a
    background thread (``prefetched``): the row groups' order and the share's bounds follow
    from ``(seed, epoch, rank)``."""

    def __init__(self, data: ParquetSet, columns: Columns, *, rank: int, world: int, seed: int,
                 chunk_rows: int = 4096) -> None:
        self.data, self.columns = data, columns
        self.rank, self.world, self.seed, self.chunk_rows = rank, world, seed, chunk_rows

    @property
    def rows(self) -> int:
        return self.data.share_rows(self.rank, self.world)

    def chunks(self, epoch: int) -> Iterator[Pair]:
        pieces = self.data.share(epoch, self.seed, self.rank, self.world)
        return prefetched(read_share(self.data, pieces, self.columns, self.chunk_rows))

    def close(self) -> None:
        pass
