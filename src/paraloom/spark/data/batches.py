"""How many minibatches a partition holds (which rows each takes: ``stream.stream_batches``)."""

from __future__ import annotations

__all__ = ["batch_count"]


def batch_count(n: int, batch_size: int, drop_last: bool = False) -> int:
    """Minibatches in ``n`` rows (the last one may be short, unless ``drop_last`` drops it)."""
    return n // batch_size if drop_last else -(-n // batch_size)
