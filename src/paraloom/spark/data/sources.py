"""Where a barrier task's training rows come from, epoch after epoch (``TaskData``).

``SpilledPartition``: the task's partition of an RDD or DataFrame, stored on the executor's
local disk as it streams in, then read back once per epoch. ``ParquetShare``: the task's share
of a Parquet set (``ParquetSet.share``), read from the files every epoch with nothing stored.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Protocol

from paraloom.spark.data.parquet import ParquetSet, prefetched, read_share
from paraloom.spark.data.rows import Columns, Pair
from paraloom.spark.data.stream import Spill

__all__ = ["TaskData", "SpilledPartition", "ParquetShare"]


class TaskData(Protocol):
    """A task's training rows: the same count every epoch, read as chunks in a fixed order."""

    @property
    def rows(self) -> int: ...

    def chunks(self, epoch: int) -> Iterable[Pair]:
        """This epoch's rows as ``(features, label)`` chunks, in the epoch's order."""
        ...

    def close(self) -> None: ...


class SpilledPartition:
    """A partition's chunks on local disk (written once, on creation), in arrival order."""

    def __init__(self, chunks: Iterable[Pair], directory: str | None = None) -> None:
        self._spill = Spill(directory)
        try:
            self._spill.store(chunks)
        except BaseException:
            self._spill.close()
            raise

    @property
    def rows(self) -> int:
        return self._spill.rows

    def chunks(self, epoch: int) -> Iterator[Pair]:
        return self._spill.chunks()

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
