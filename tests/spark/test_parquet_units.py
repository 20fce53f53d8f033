"""Parquet straight into training, without Spark: the shares, the reading, the checks."""

from __future__ import annotations

import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from paraloom.spark.data import Columns, Features
from paraloom.spark.data.arrow import arrow_column
from paraloom.spark.data.parquet import (
    ParquetSet,
    RowGroup,
    prefetched,
    read_share,
    scan_parquet,
)
from paraloom.spark.data.sources import ParquetShare
from paraloom.spark.training.task import batch_tensors

pytestmark = pytest.mark.timeout(60)

COLUMNS = Columns.of("features", "label")


def _write(path, ids: np.ndarray, row_group: int, **extra) -> None:
    features = np.stack([ids, ids * 2], 1).astype(np.float32)
    offsets = pa.array(np.arange(0, 2 * len(ids) + 1, 2, dtype=np.int32))
    table = pa.table({"features": pa.ListArray.from_arrays(offsets, pa.array(features.ravel())),
                      "label": pa.array(ids.astype(np.int64)), **extra})
    pq.write_table(table, path, row_group_size=row_group)


@pytest.fixture()
def folder(tmp_path):
    """1,000 rows with ids 0..999 in three files of uneven row groups, and Spark's extras."""
    cuts = [0, 130, 610, 1000]
    here = tmp_path / "data"
    here.mkdir()
    for i, group in enumerate((50, 200, 77)):
        _write(here / f"part-{i}.parquet", np.arange(cuts[i], cuts[i + 1]), group)
    (here / "_SUCCESS").write_text("")
    (here / ".part-0.parquet.crc").write_text("not parquet")
    return here


def _ids(chunks) -> list[int]:
    out = []
    for x, y in chunks:
        assert np.array_equal(x[:, 1], 2 * x[:, 0]) and np.array_equal(x[:, 0], y)
        out.extend(y.tolist())
    return out


def test_every_row_once_per_epoch_in_shares_equal_to_one_row():
    data = ParquetSet(("a", "b"), tuple(RowGroup(i % 2, i, n) for i, n in
                                          enumerate([7, 100, 3, 50, 1, 39])), ("x",))
    assert data.rows == 200 and [data.share_rows(r, 3) for r in range(3)] == [66, 67, 67]
    orders = []
    for epoch in range(3):
        rows = []
        for rank in range(3):
            pieces = data.share(epoch, seed=5, rank=rank, world=3)
            assert pieces == data.share(epoch, seed=5, rank=rank, world=3)  # a re-run's
            assert sum(p.stop - p.start for p in pieces) == data.share_rows(rank, 3)
            rows += [(p.group.index, i) for p in pieces for i in range(p.start, p.stop)]
        assert sorted(rows) == sorted((g.index, i) for g in data.groups for i in range(g.rows))
        orders.append(rows)
    assert orders[0] != orders[1]  # each epoch draws its own order of the row groups
    with pytest.raises(ValueError, match="rank=3"):
        data.share(0, 0, 3, 3)


def test_shares_stream_the_right_rows_from_the_files(folder):
    data = scan_parquet([str(folder)], COLUMNS)
    assert len(data.files) == 3 and data.rows == 1000  # _SUCCESS and .crc left out
    assert [g.rows for g in data.groups][:3] == [50, 50, 30]
    seen = []
    for rank in range(3):
        pieces = data.share(1, seed=0, rank=rank, world=3)
        ids = _ids(read_share(data, pieces, COLUMNS, chunk_rows=64))
        expected = [data.groups.index(p.group) for p in pieces]
        assert len(ids) == data.share_rows(rank, 3) and len(expected) == len(pieces)
        share = ParquetShare(data, COLUMNS, rank=rank, world=3, seed=0, chunk_rows=64)
        assert _ids(share.chunks(1)) == ids and share.rows == len(ids)  # prefetched, same
        seen += ids
    assert sorted(seen) == list(range(1000))


def test_file_uris_with_non_ascii_characters_and_escapes_are_read(tmp_path):
    """Spark's file URIs keep non-ASCII characters raw (pyarrow refused them) and escape a
    space as %20: both are read, from the folder's URI and from its files'."""
    here = tmp_path / "daten_ü x"
    here.mkdir()
    _write(here / "part-0%.parquet", np.arange(10), 4)
    uri = "file://" + str(here).replace(" ", "%20")
    for paths in ([uri], [uri + "/part-0%25.parquet"]):
        data = scan_parquet(paths, COLUMNS)
        assert data.rows == 10
        pieces = data.share(0, seed=0, rank=0, world=1)
        assert sorted(_ids(read_share(data, pieces, COLUMNS, chunk_rows=4))) == list(range(10))


def test_bad_paths_and_columns_fail_before_training_naming_file_and_column(folder, tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        scan_parquet([str(tmp_path / "nowhere")], COLUMNS)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no Parquet files"):
        scan_parquet([str(empty)], COLUMNS)
    (empty / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match=r"notes\.txt is not a Parquet file"):
        scan_parquet([str(empty)], COLUMNS)
    with pytest.raises(ValueError, match=r"column 'pixels' is not in .*part-0\.parquet"):
        scan_parquet([str(folder)], Columns.of("pixels", "label"))
    odd = tmp_path / "odd"
    odd.mkdir()
    _write(odd / "a.parquet", np.arange(5), 5)
    table = pq.read_table(odd / "a.parquet")
    pq.write_table(table.set_column(1, "label", table.column("label").cast(pa.int32())),
                   odd / "b.parquet")
    both = scan_parquet([str(odd)], COLUMNS)  # Spark reads int32 beside int64: so does this
    share = ParquetShare(both, COLUMNS, rank=0, world=1, seed=0, chunk_rows=4)
    assert sorted(_ids(share.chunks(1))) == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    pq.write_table(table.set_column(1, "label", table.column("label").cast(pa.uint8())),
                   odd / "b.parquet")
    with pytest.raises(TypeError, match=r"'label' is int64 .* but uint8"):
        scan_parquet([str(odd)], COLUMNS)  # joined with int64, numpy would make it float64
    pq.write_table(table.set_column(0, "features", table.column("features").cast(
        pa.list_(pa.float64()))), odd / "b.parquet")
    with pytest.raises(TypeError, match=r"'features' is list<\w+: float> in .*a\.parquet but "
                                        r"list<\w+: double> in .*b\.parquet"):
        scan_parquet([str(odd)], COLUMNS)  # Spark refuses to merge these too
    words = tmp_path / "words.parquet"
    _write(words, np.arange(4), 4, name=pa.array(["a", "b", "c", "d"]))
    with pytest.raises(TypeError, match=r"column 'name' in .*words\.parquet has type string"
                                        r".*StringIndexer") as caught:
        scan_parquet([str(words)], Columns.of(["features", "name"], "label"))
    assert "fit_paths" not in str(caught.value)  # fit(df) of a Parquet DataFrame says it too


def test_a_shape_the_model_cannot_take_fails_on_the_driver(folder):
    features = Features((3, 3))
    with pytest.raises(ValueError, match="3, 3"):
        scan_parquet([str(folder)], COLUMNS, check=lambda pair: batch_tensors(pair, features))
    found = scan_parquet([str(folder)], COLUMNS,
                         check=lambda pair: batch_tensors(pair, Features((2,))))
    assert found.rows == 1000


def test_spark_ml_vectors_dense_and_sparse_read_as_dense_rows():
    kind = pa.struct([("type", pa.int8()), ("size", pa.int32()),
                      ("indices", pa.list_(pa.int32())), ("values", pa.list_(pa.float64()))])
    rows = pa.array([{"type": 1, "size": None, "indices": None, "values": [1.0, 2.0, 3.0]},
                     {"type": 0, "size": 3, "indices": [2], "values": [5.0]},
                     {"type": 0, "size": 3, "indices": [0, 1], "values": [7.0, 8.0]},
                     {"type": 1, "size": None, "indices": None, "values": [4.0, 4.0, 4.0]}],
                    kind)
    assert arrow_column(rows, "v").tolist() == [[1, 2, 3], [0, 0, 5], [7, 8, 0], [4, 4, 4]]
    assert arrow_column(rows.slice(1, 2), "v").tolist() == [[0, 0, 5], [7, 8, 0]]
    with pytest.raises(TypeError, match="struct"):
        arrow_column(pa.array([{"a": 1}]), "s")


def test_decimals_read_as_doubles_and_whole_decimals_as_longs(tmp_path):
    """A database's exact decimals (prices: decimal(10, 4); class ids: decimal(3, 0)), as
    Spark writes them to Parquet, are numbers to train on."""
    from decimal import Decimal

    prices = pa.array([Decimal("1.2500"), Decimal("-3.0625")], pa.decimal128(10, 4))
    ids = pa.array([Decimal("7"), Decimal("2")], pa.decimal128(3, 0))
    huge = pa.array([Decimal("12345678901234567890")], pa.decimal128(20, 0))
    lists = pa.array([[Decimal("0.5"), Decimal("1.5")]], pa.list_(pa.decimal128(4, 1)))
    read = arrow_column(prices, "price")
    assert read.dtype == np.float64 and read.tolist() == [1.25, -3.0625]
    assert arrow_column(ids, "digit").dtype == np.int64
    assert arrow_column(ids, "digit").tolist() == [7, 2]
    assert arrow_column(huge, "id").dtype == np.float64  # past int64: a double
    assert arrow_column(lists, "f").tolist() == [[0.5, 1.5]]
    path = tmp_path / "prices.parquet"
    pq.write_table(pa.table({"price": prices, "qty": pa.array([1.0, 2.0]), "digit": ids}), path)
    found = scan_parquet([str(path)], Columns.of(["price", "qty"], "digit"))
    assert found.rows == 2


def test_prefetching_raises_the_readers_error_and_stops_when_closed():
    def failing():
        yield np.zeros(1), np.zeros(1)
        raise OSError("disk gone")

    got = prefetched(failing())
    next(got)
    with pytest.raises(OSError, match="disk gone"):
        next(got)

    made = []

    def endless():
        while True:
            made.append(1)
            yield np.zeros(1), np.zeros(1)

    before = threading.active_count()
    got = prefetched(endless(), depth=2)
    next(got)
    got.close()
    time.sleep(0.3)
    count = len(made)
    time.sleep(0.3)
    assert len(made) == count <= 5  # bounded read-ahead, and nothing after the close
    assert threading.active_count() == before
