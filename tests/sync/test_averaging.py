"""average_tensors_: bucketed, non-blocking averaging gives the same bits as one all-reduce."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from paraloom.sync.averaging import _buckets, average_tensors_


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


def test_buckets_keep_order_and_the_byte_limit() -> None:
    tensors = [torch.zeros(n) for n in (4, 4, 10, 1, 1)]  # 16, 16, 40, 4, 4 bytes
    runs = _buckets(tensors, 32)
    assert [[t.numel() for t in run] for run in runs] == [[4, 4], [10], [1, 1]]
    assert [t for run in runs for t in run] == tensors
