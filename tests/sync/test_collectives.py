"""Packed collectives: averaging gives the same bits as one all-reduce; a broadcast gives
rank 0's tensors to every rank, whatever their dtypes and bucket sizes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from paraloom.sync.collectives import average_tensors_, broadcast_tensors_, buckets


def _tensors(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return [torch.randn(3, 5, generator=g), torch.randn(100, generator=g),
            torch.randn(7, generator=g, dtype=torch.float64),
            torch.tensor([10 + rank], dtype=torch.int64),  # a counter: rank 0's wins
            torch.randn(2, 2, 2, generator=g)]


def _average(rank: int, world_size: int, bucket_bytes: int) -> dict[str, Any]:
    import torch.distributed as dist

    tensors = _tensors(rank)
    sent = average_tensors_(tensors, dist.group.WORLD, world_size, bucket_bytes=bucket_bytes)
    return {"values": [t.tolist() for t in tensors], "sent": sent}


@pytest.mark.parametrize("bucket_bytes", [8, 64, 2**20])
def test_bucketed_averaging_is_the_exact_mean_on_every_rank(pool, bucket_bytes: int) -> None:
    first, second = pool.run(_average, bucket_bytes=bucket_bytes)
    assert first["values"] == second["values"]
    a, b = _tensors(0), _tensors(1)
    for got, x, y in zip(first["values"], a, b, strict=True):
        expected = x if not x.is_floating_point() else (x + y) / 2
        assert torch.equal(torch.tensor(got, dtype=x.dtype), expected)
    # A ring all-reduce over 2 ranks sends the data once; the counter's broadcast, 8 bytes.
    floats = sum(t.numel() * t.element_size() for t in a if t.is_floating_point())
    assert first["sent"] == second["sent"] == floats + 8


def _weighted(rank: int, world_size: int, shares: list[float], half: bool) -> dict[str, Any]:
    import torch.distributed as dist

    tensors = _tensors(rank)
    if half:  # no float32 or float64 bucket to carry the shares: they travel on their own
        tensors = [t.half() if t.is_floating_point() else t for t in tensors]
    if shares[rank] == 0:
        tensors[0][0, 0] = float("nan")  # a replica left out: its values must not count
    before = [t.clone() for t in tensors]
    sent = average_tensors_(tensors, dist.group.WORLD, world_size, share=shares[rank],
                            bucket_bytes=64)
    return {"values": [t.tolist() for t in tensors], "before": [t.tolist() for t in before],
            "sent": sent}


@pytest.mark.parametrize("half", [False, True])
def test_a_weighted_average_weighs_each_rank_by_its_share(pool, half: bool) -> None:
    a, b = _tensors(0), _tensors(1)
    if half:
        a, b = ([t.half() if t.is_floating_point() else t for t in ts] for ts in (a, b))
    equal = pool.run(_weighted, shares=[1.0, 1.0], half=half)
    for got, x, y in zip(equal[0]["values"], a, b, strict=True):  # the plain mean, bit for bit
        expected = x if not x.is_floating_point() else (x + y) / 2
        assert torch.equal(torch.tensor(got, dtype=x.dtype), expected)
    left_out = pool.run(_weighted, shares=[1.0, 0.0], half=half)
    assert left_out[0]["values"] == left_out[1]["values"]
    for got, x in zip(left_out[0]["values"], a, strict=True):  # rank 0's own values
        assert torch.equal(torch.tensor(got, dtype=x.dtype), x)
    third = pool.run(_weighted, shares=[1.0, 0.5], half=half)
    for got, x, y in zip(third[0]["values"], a, b, strict=True):
        expected = x if not x.is_floating_point() else (x + 0.5 * y) / 1.5
        torch.testing.assert_close(torch.tensor(got, dtype=x.dtype), expected,
                                   atol=2e-3 if half else 1e-6, rtol=1e-3 if half else 1e-6)
    nobody = pool.run(_weighted, shares=[0.0, 0.0], half=half)
    for rank in (0, 1):  # nothing trained: every rank keeps what it had (NaN included)
        for got, before in zip(nobody[rank]["values"][:3], nobody[rank]["before"][:3],
                               strict=True):
            assert torch.equal(torch.tensor(got).nan_to_num(7.0),
                               torch.tensor(before).nan_to_num(7.0))


def test_buckets_keep_order_and_the_byte_limit() -> None:
    tensors = [torch.zeros(n) for n in (4, 4, 10, 1, 1)]  # 16, 16, 40, 4, 4 bytes
    runs = buckets(tensors, 32)
    assert [[t.numel() for t in run] for run in runs] == [[4, 4], [10], [1, 1]]
    assert [t for run in runs for t in run] == tensors


def _broadcast(rank: int, world_size: int, bucket_bytes: int) -> dict[str, Any]:
    import torch.distributed as dist

    tensors = _tensors(rank)
    views = [tensors[1][10:20]]  # a view: written through to its base
    sent = broadcast_tensors_(tensors + views, dist.group.WORLD, world_size,
                              bucket_bytes=bucket_bytes)
    return {"values": [t.tolist() for t in tensors], "sent": sent,
            "versions": [t._version for t in tensors]}


@pytest.mark.parametrize("bucket_bytes", [8, 2**20])
def test_broadcast_gives_every_rank_the_first_ranks_tensors(pool, bucket_bytes: int) -> None:
    first, second = pool.run(_broadcast, bucket_bytes=bucket_bytes)
    expected = _tensors(0)
    for got in (first["values"], second["values"]):
        for values, x in zip(got, expected, strict=True):
            assert torch.equal(torch.tensor(values, dtype=x.dtype), x)
    # Rank 0 sends each tensor once (the view too); the others send nothing.
    assert first["sent"] == sum(t.numel() * t.element_size() for t in expected) + 40
    assert second["sent"] == 0
    # The receivers' tensors were written in place: their version counters moved.
    assert all(v > 0 for v in second["versions"]) and not any(first["versions"])
