"""Counters and timings of a ParallelInference, and the plain dict that ``stats()`` returns.

Keys of the dict (stable; ``paraloom.serving`` exports them as metrics):

``requests``        requests accepted into the queue (or run in place)
``completed``       requests answered with an output
``failed``          accepted requests that ended without an output (an error, a timeout, a
                    cancel, a close); ``requests == completed + failed + queued + running``
``rows``            rows run through the model (requests can carry several rows)
``batches``         forward passes (re-runs of a failed batch excluded)
``batch_size_histogram``  {rows in a batch: number of batches}
``queue_time_ms`` / ``forward_time_ms``  {"p50", "p90", "p99", "max", "mean", "count"} over the
                    last ``window`` requests / batches (queue time: arrival to forward start)
``rejections``      {reason: count} of requests refused (before acceptance) or dropped (after);
                    reasons: ``queue_full``, ``timeout``, ``cancelled``, ``invalid``, ``closed``,
                    ``error``
"""

from __future__ import annotations

import math
import threading
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from typing import TypedDict

from paraloom.inference.totals import TotalsRecorder

__all__ = ["StatsRecorder", "percentiles", "REJECTION_REASONS", "Percentiles", "RecorderStats",
           "InferenceStats"]

REJECTION_REASONS = ("queue_full", "timeout", "cancelled", "invalid", "closed", "error")


class Percentiles(TypedDict):
    """A timing summary, in the unit of the samples (milliseconds in the stats)."""

    p50: float
    p90: float
    p99: float
    max: float
    mean: float
    count: int


class RecorderStats(TypedDict):
    """What :meth:`StatsRecorder.as_dict` returns (the keys are described in the module doc)."""

    requests: int
    completed: int
    failed: int
    rows: int
    batches: int
    mean_batch_rows: float
    batch_size_histogram: dict[int, int]
    rejections: dict[str, int]
    queue_time_ms: Percentiles
    forward_time_ms: Percentiles


class InferenceStats(RecorderStats):
    """What ``ParallelInference.stats()`` returns: the recorder's counters and the pool's setup."""

    mode: str
    workers: int
    devices: list[str]
    precision: str
    model_version: int
    closed: bool
    queued: int


def percentiles(samples: Sequence[float]) -> Percentiles:
    """p50/p90/p99 (nearest rank), max, mean and count of samples (zeros when empty)."""
    if not samples:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0, "mean": 0.0, "count": 0}
    ordered = sorted(samples)
    n = len(ordered)

    def rank(q: float) -> float:
        return ordered[min(n - 1, max(0, math.ceil(q * n) - 1))]

    return {"p50": rank(0.50), "p90": rank(0.90), "p99": rank(0.99), "max": ordered[-1],
            "mean": sum(ordered) / n, "count": n}


class StatsRecorder:
    """Thread-safe counters; timings are kept for the last ``window`` samples only (bounded)."""

    def __init__(self, window: int = 10_000) -> None:
        self._lock = threading.Lock()
        self._requests = 0
        self._completed = 0
        self._failed = 0
        self._rows = 0
        self._batches = 0
        self._batch_sizes: Counter[int] = Counter()
        self._queue_ms: deque[float] = deque(maxlen=window)
        self._forward_ms: deque[float] = deque(maxlen=window)
        self._rejections: Counter[str] = Counter({reason: 0 for reason in REJECTION_REASONS})
        self.totals = TotalsRecorder()
        """Cumulative counts and nanoseconds by model version (Triton's statistics)."""

    def accepted(self) -> None:
        """Count one request accepted."""
        with self._lock:
            self._requests += 1

    def rejected(self, reason: str, count: int = 1) -> None:
        """Count requests refused before they were accepted, by reason (REJECTION_REASONS)."""
        with self._lock:
            self._rejections[reason] += count

    def dropped(self, reason: str, count: int = 1) -> None:
        """Count accepted requests that ended without an output, by reason."""
        with self._lock:
            self._rejections[reason] += count
            self._failed += count

    def batch(self, rows: int, queue_seconds: Iterable[float], forward_seconds: float) -> None:
        """Record one forward pass: its rows, its requests' queue times, its duration."""
        with self._lock:
            self._batches += 1
            self._rows += rows
            self._batch_sizes[rows] += 1
            self._queue_ms.extend(s * 1e3 for s in queue_seconds)
            self._forward_ms.append(forward_seconds * 1e3)

    def finished(self, completed: int) -> None:
        """Count requests answered with an output."""
        with self._lock:
            self._completed += completed

    def as_dict(self) -> RecorderStats:
        """A JSON-friendly copy of every counter and the timing percentiles, taken now."""
        with self._lock:
            queue_ms, forward_ms = list(self._queue_ms), list(self._forward_ms)
            requests, completed, failed = self._requests, self._completed, self._failed
            rows, batches = self._rows, self._batches
            histogram = dict(sorted(self._batch_sizes.items()))
            rejections = dict(self._rejections)
        return {
            "requests": requests, "completed": completed, "failed": failed, "rows": rows,
            "batches": batches, "mean_batch_rows": rows / batches if batches else 0.0,
            "batch_size_histogram": histogram, "rejections": rejections,
            "queue_time_ms": percentiles(queue_ms), "forward_time_ms": percentiles(forward_ms),
        }
