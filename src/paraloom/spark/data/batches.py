"""How many minibatches a partition holds (which rows each takes: ``stream.stream_batches``)."""

from __future__ import annotations

__all__ = ["batch_count"]


def batch_count(n: int, batch_size: int) -> int:
    """Minibatches in ``n`` rows (the last one may be short)."""
    return -(-n // batch_size)
