"""Streamed minibatches: every row once per epoch, bounded windows, skipping, spills."""

from __future__ import annotations

import os

import numpy as np
import pytest

from paraloom.spark.data.stream import Spill, stream_batches, windows


def _chunks(n: int, size: int):
    for start in range(0, n, size):
        ids = np.arange(start, min(n, start + size))
        yield (np.stack([ids, ids * 2], 1).astype(np.float32), (ids, ids % 3))


def test_every_row_once_per_epoch_in_a_fixed_window_shuffled_order():
    def epoch(e):
        return list(stream_batches(_chunks(1000, 64), 32, seed=1, epoch=e, rank=0,
                                   window_rows=200))
    batches = epoch(0)
    ids = np.concatenate([y[0] for _, y in batches])
    assert sorted(ids.tolist()) == list(range(1000))  # every row once
    assert [len(x) for x, _ in batches] == [32] * 31 + [8]  # only the last is short
    assert all((x[:, 1] == 2 * y[0]).all() and (y[1] == y[0] % 3).all() for x, y in batches)
    assert ids.tolist() != list(range(1000))  # shuffled ...
    assert np.abs(ids - np.arange(1000)).max() < 256 + 32  # ... within windows of 256 rows
    again = np.concatenate([y[0] for _, y in epoch(0)])
    assert np.array_equal(ids, again)  # a retried task sees the same minibatches
    assert not np.array_equal(ids, np.concatenate([y[0] for _, y in epoch(1)]))


def test_a_round_starts_mid_epoch_with_the_same_minibatches():
    whole = list(stream_batches(_chunks(500, 50), 16, seed=0, epoch=2, rank=1, window_rows=100))
    part = list(stream_batches(_chunks(500, 50), 16, seed=0, epoch=2, rank=1, window_rows=100,
                               first=9, count=5))
    assert len(part) == 5
    for (x, y), (wx, wy) in zip(part, whole[9:14], strict=True):
        assert np.array_equal(x, wx) and np.array_equal(y[0], wy[0])
    tail = list(stream_batches(_chunks(500, 50), 16, seed=0, epoch=2, rank=1, window_rows=100,
                               first=30, count=5))
    assert [len(x) for x, _ in tail] == [16, 4]  # 32 minibatches, the last short
    assert list(stream_batches(_chunks(500, 50), 16, seed=0, epoch=0, rank=0, window_rows=100,
                               first=40, count=5)) == []


def test_drop_last_leaves_out_the_short_last_minibatch_only():
    from paraloom.spark.data import batch_count

    kept = list(stream_batches(_chunks(1000, 64), 32, seed=1, epoch=0, rank=0,
                               window_rows=200, drop_last=True))
    every = list(stream_batches(_chunks(1000, 64), 32, seed=1, epoch=0, rank=0,
                                window_rows=200))
    assert [len(x) for x, _ in kept] == [32] * 31 == [len(x) for x, _ in every[:-1]]
    assert all(np.array_equal(a[0], b[0]) for a, b in zip(kept, every, strict=False))
    assert batch_count(1000, 32, drop_last=True) == 31 and batch_count(1000, 32) == 32
    assert batch_count(64, 32, drop_last=True) == 2 and batch_count(31, 32, drop_last=True) == 0


def test_windows_hold_a_bounded_number_of_rows():
    sizes = [sum(len(c[0]) for c in w) for w in windows(_chunks(1000, 64), 200)]
    assert sizes == [256, 256, 256, 232]


def test_a_spill_replays_the_chunks_and_removes_its_file(tmp_path):
    with Spill(str(tmp_path)) as spill:
        passed = [c[1][0].tolist() for c in spill.write(_chunks(300, 128))]
        assert spill.rows == 300 and spill.chunks_written == 3 and os.path.exists(spill.path)
        back = list(spill.chunks())
        assert [c[1][0].tolist() for c in back] == passed
        assert isinstance(back[0][1], tuple) and back[0][0].dtype == np.float32
        assert [c[1][0].tolist() for c in spill.chunks()] == passed  # once per epoch
    assert not os.listdir(tmp_path)


def test_a_worker_holds_a_few_chunks_whatever_the_partition_size():
    import weakref

    from paraloom.spark.training.base import TrainingMaster

    alive = set()

    def tracked(n: int):
        for i, (x, y) in enumerate(_chunks(n, 64)):
            alive.add(i)
            weakref.finalize(x, alive.discard, i)
            yield x, y

    most = {}
    for n in (2_000, 20_000):
        alive.clear()
        peak = 0
        for _ in stream_batches(tracked(n), 32, seed=0, epoch=0, rank=0, window_rows=128):
            peak = max(peak, len(alive))  # arrays are freed by reference counting
        most[n] = peak
    assert most[2_000] == most[20_000] <= 4  # a window of 2 chunks, one read ahead, one left
    with pytest.raises(ValueError, match="prefetch_batches"):
        TrainingMaster(32, 2, prefetch_batches=0)
