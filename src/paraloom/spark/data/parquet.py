"""Parquet read straight into training: each task streams its own share of the row groups.

``scan_parquet`` runs on the driver: it lists the files, reads their footers (not their data),
and checks before any training that every file holds the columns, with one type each, and that
a sample row decodes to the shapes the model takes; it returns a ``ParquetSet``, the row groups
and their sizes. ``ParquetSet.share`` cuts one epoch's row sequence into ``world`` contiguous
shares of equal size (to one row): the row groups in an order drawn from ``(seed, epoch)``,
then rank ``k`` takes rows ``[k*N/world, (k+1)*N/world)``, so a share may start or end inside a
row group. ``read_share`` streams a share as ``(features, label)`` chunks, a bounded number of
record batches at a time, decoded on a background thread while the model trains.

Everything follows from the seed, the epoch and the rank: a re-run task reads the same rows in
the same order, with no shuffle, persist or count of the rows on the way.
"""

from __future__ import annotations

import queue
import threading
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from paraloom.spark.data.arrays import take
from paraloom.spark.data.arrow import batch_pair
from paraloom.spark.data.rows import Columns, Pair, cast_hint

if TYPE_CHECKING:
    import pyarrow as pa  # type: ignore[import-untyped]
    import pyarrow.fs as pafs  # type: ignore[import-untyped]

__all__ = ["RowGroup", "Piece", "ParquetSet", "MissingColumn", "scan_parquet", "read_share",
           "prefetched"]

_PREFETCH = 2
"""Chunks decoded ahead of the training loop."""


@dataclass(frozen=True)
class RowGroup:
    """One row group: which file (an index into ``ParquetSet.files``), which group, its rows."""

    file: int
    index: int
    rows: int


@dataclass(frozen=True)
class Piece:
    """Rows ``[start, stop)`` of one row group: a share is a list of pieces."""

    group: RowGroup
    start: int
    stop: int


@dataclass(frozen=True)
class ParquetSet:
    """Parquet files as their row groups: what the driver learned from the footers."""

    files: tuple[str, ...]
    groups: tuple[RowGroup, ...]
    names: tuple[str, ...]
    """The columns read, as the files name them."""

    @property
    def rows(self) -> int:
        return sum(g.rows for g in self.groups)

    def share_rows(self, rank: int, world: int) -> int:
        """How many rows rank ``rank`` of ``world`` reads every epoch (all within one row)."""
        return (rank + 1) * self.rows // world - rank * self.rows // world

    def share(self, epoch: int, seed: int, rank: int, world: int) -> list[Piece]:
        """Rank ``rank``'s pieces for ``epoch``: its contiguous slice of the row groups in the
        epoch's order (drawn from ``(seed, epoch)``, the same on every rank)."""
        if not 0 <= rank < world:
            raise ValueError(f"rank={rank} outside 0..{world - 1}")
        order = np.random.default_rng([seed, epoch, 0x7061]).permutation(len(self.groups))
        lo, hi = rank * self.rows // world, (rank + 1) * self.rows // world
        pieces, at = [], 0
        for i in order:
            group = self.groups[int(i)]
            start, stop = max(lo - at, 0), min(hi - at, group.rows)
            if start < stop:
                pieces.append(Piece(group, start, stop))
            at += group.rows
            if at >= hi:
                break
        return pieces


def _filesystem(path: str) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem and the path in it: a URI (``hdfs://``, ``s3://``,
    ``file://``) through ``FileSystem.from_uri``, anything else on the local disk. A URI's
    non-ASCII characters are percent-encoded first: Spark's file URIs keep them raw
    (``file:///data/daten_ü/...``), and pyarrow refuses those."""
    import pyarrow.fs as pafs

    if "://" in path:
        return pafs.FileSystem.from_uri(_quoted(path))  # type: ignore[no-any-return]
    return pafs.LocalFileSystem(), path


_URI_CHARACTERS = "/:%@!$&'()*+,;=?#[]~"
"""What a URI may hold as it is (RFC 3986's reserved characters, and ``%`` of the escapes
already there), beside letters, digits and ``-._``."""


def _hidden(name: str) -> bool:
    """Spark's rule: files and folders starting with ``_`` or ``.`` are not data."""
    return name.startswith(("_", "."))


def _list(path: str) -> list[str]:
    """The data files at ``path`` (a file, or every file under a folder), sorted."""
    import pyarrow.fs as pafs

    fs, inner = _filesystem(path)
    info = fs.get_file_info(inner)
    if info.type == pafs.FileType.NotFound:
        glob = any(c in path for c in "*?[{")
        raise ValueError(f"Parquet path {path!r} does not exist" + (
            "; fit_paths takes files and folders, not globs: pass the folder, or "
            "fit(spark.read.parquet(...)), which Spark reads glob and all" if glob else ""))
    if info.type == pafs.FileType.File:
        return [path]
    found = fs.get_file_info(pafs.FileSelector(inner, recursive=True))
    keep = [f.path for f in found if f.type == pafs.FileType.File
            and not any(_hidden(part) for part in f.path[len(inner):].split("/") if part)]
    if "://" not in path:
        return sorted(keep)
    # The files as URIs of the folder's: its scheme and host before each file's path, escaped.
    uri, escaped = _quoted(path), _quoted(inner, decoded=True)
    prefix = uri[:len(uri) - len(escaped)] if uri.endswith(escaped) else \
        path[:len(path) - len(inner)]
    return sorted(prefix + _quoted(p, decoded=True) for p in keep)


def _quoted(uri: str, decoded: bool = False) -> str:
    """``uri`` with what a URI may not hold as it is percent-encoded; ``decoded``: a path as
    the filesystem names it, whose ``%`` is a character (escaped too), not an escape's."""
    return urllib.parse.quote(uri, safe=_URI_CHARACTERS.replace("%", "") if decoded
                              else _URI_CHARACTERS)


def _open(path: str) -> Any:
    import pyarrow.parquet as pq  # type: ignore[import-untyped]

    fs, inner = _filesystem(path)
    # Streamed column chunks: memory stays at a few record batches whatever the row groups'
    # size (pre-buffering held whole row groups: 380 MB for one of 1.5M rows).
    return pq.ParquetFile(fs.open_input_file(inner), pre_buffer=False, buffer_size=1 << 20)


def _footer(path: str) -> tuple[pa.Schema, list[int]]:
    try:
        with _open(path) as f:
            meta = f.metadata
            return f.schema_arrow, [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise ValueError(f"{path} is not a Parquet file ({e}); keep only Parquet "
                         f"files in the folder, or name the files") from e


def _check_type(kind: pa.DataType, name: str, path: str) -> None:
    from paraloom.spark.data.arrow import decodable

    if not decodable(kind):
        raise TypeError(f"column {name!r} in {path} has type {kind}; expected "
                        f"numbers, (nested) lists of numbers or Spark ML vectors. "
                        f"{cast_hint([str(kind)])}, and train on that DataFrame")


def _same_kind(a: pa.DataType, b: pa.DataType) -> bool:
    """Whether two files' types of a column decode alike: equal, or signed integers of any
    width (as Spark reads ``int`` beside ``long``; chunks of both join as the wider), in lists
    nested alike. Unsigned beside signed is not: joined, they would turn floating-point."""
    import pyarrow as pa

    while pa.types.is_list(a) and pa.types.is_list(b):
        a, b = a.value_type, b.value_type
    return bool(a == b or (pa.types.is_signed_integer(a) and pa.types.is_signed_integer(b)))


class MissingColumn(ValueError):
    """A column the files were to be read by is not in one of them (by that exact name)."""


def _check_schema(path: str, schema: pa.Schema, names: Sequence[str],
                  first: tuple[str, pa.Schema] | None) -> None:
    for name in names:
        if schema.get_field_index(name) < 0:
            hive = f"/{name}=" in path  # a partition column lives in the folder names
            raise MissingColumn(f"column {name!r} is not in {path}; it has "
                             f"{schema.names}" + (
                                 f". {name!r} is a partition column (the folders' "
                                 f"{name}=... names), which fit_paths does not read: use "
                                 "fit(spark.read.parquet(...)), which adds it" if hive else ""))
        kind = schema.field(name).type
        _check_type(kind, name, path)
        if first is not None and not _same_kind(first[1].field(name).type, kind):
            raise TypeError(f"column {name!r} is {first[1].field(name).type} in "
                            f"{first[0]} but {kind} in {path}; rewrite the files with one "
                            f"schema (spark.read.parquet(...).write.parquet(...))")


def scan_parquet(paths: Sequence[str], columns: Columns,
                 check: Callable[[Pair], object] | None = None) -> ParquetSet:
    """The row groups of every Parquet file under ``paths``, with the columns checked.

    Reads the footers only (on a few threads), then decodes a few rows of the first non-empty
    file through ``check`` (which raises for a shape the model cannot take). Raises
    ``ValueError`` for a path with no Parquet files, a file that is not Parquet or a missing
    column, and ``TypeError`` for a column of the wrong type or differing types between files,
    each naming the file and the column.
    """
    files: list[str] = []
    for path in paths:
        files.extend(_list(path))
    if not files:
        raise ValueError(f"no Parquet files under {list(paths)}")
    names = tuple(columns.names())
    with ThreadPoolExecutor(min(8, len(files))) as pool:
        footers = list(pool.map(_footer, files))
    first: tuple[str, pa.Schema] | None = None
    groups: list[RowGroup] = []
    for i, (path, (schema, sizes)) in enumerate(zip(files, footers, strict=True)):
        _check_schema(path, schema, names, first)
        first = first or (path, schema)
        groups.extend(RowGroup(i, g, n) for g, n in enumerate(sizes) if n)
    found = ParquetSet(tuple(files), tuple(groups), names)
    if not found.rows:
        raise ValueError(f"the Parquet files under {list(paths)} hold no rows")
    if check is not None:
        rows = min(4, groups[0].rows)
        x, y = next(_read_piece(found, Piece(groups[0], 0, rows), columns, 4, {}))
        every = np.arange(rows)
        check((take(x, every), take(y, every)))  # copies: Arrow's own memory is read-only
    return found


def _read_piece(data: ParquetSet, piece: Piece, columns: Columns, chunk_rows: int,
                opened: dict[int, Any]) -> Iterator[Pair]:
    """A piece's rows as chunks of at most ``chunk_rows`` rows, decoded batch by batch."""
    f = opened.get(piece.group.file)
    if f is None:
        f = opened[piece.group.file] = _open(data.files[piece.group.file])
    at = 0
    for batch in f.iter_batches(batch_size=chunk_rows, row_groups=[piece.group.index],
                                columns=list(data.names), use_threads=False):
        lo, hi = max(piece.start - at, 0), min(piece.stop - at, batch.num_rows)
        at += batch.num_rows
        if lo < hi:
            yield batch_pair(batch.slice(lo, hi - lo), columns)
        if at >= piece.stop:
            return


def read_share(data: ParquetSet, pieces: Iterable[Piece], columns: Columns,
               chunk_rows: int = 4096) -> Iterator[Pair]:
    """The pieces' rows in order, as ``(features, label)`` chunks of at most ``chunk_rows``
    rows; one record batch decoded at a time, files closed at the end."""
    opened: dict[int, Any] = {}
    try:
        for piece in pieces:
            yield from _read_piece(data, piece, columns, chunk_rows, opened)
    finally:
        for f in opened.values():
            f.close()


_END = object()


class _Producer:
    """A thread that runs ``items`` into a queue of ``depth`` slots until told to stop."""

    def __init__(self, items: Iterator[Pair], depth: int) -> None:
        self.items = items
        self.slots: queue.Queue[object] = queue.Queue(depth)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="paraloom-parquet", daemon=True)
        self.thread.start()

    def _put(self, item: object) -> bool:
        while not self.stopped.is_set():
            try:
                self.slots.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            for item in self.items:
                if not self._put(item):
                    return
            self._put(_END)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            self._put(e)
        finally:
            close = getattr(self.items, "close", None)
            if close is not None:
                close()  # a generator's own cleanup (open files) runs on this thread

    def get(self, timeout_s: float) -> object:
        try:
            item = self.slots.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"reading Parquet gave nothing for {timeout_s:g} s") from None
        if isinstance(item, BaseException):
            raise item
        return item

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(5)


def prefetched(items: Iterator[Pair], depth: int = _PREFETCH,
               timeout_s: float = 600.0) -> Iterator[Pair]:
    """``items`` produced on a background thread, at most ``depth`` ahead (pyarrow's reading
    and decoding release the GIL, so they overlap the training step). An error in the producer
    is raised here; closing the generator stops the producer. Waits at most ``timeout_s`` for
    one item."""
    producer = _Producer(items, depth)
    try:
        while (item := producer.get(timeout_s)) is not _END:
            yield cast(Pair, item)
    finally:
        producer.stop()
