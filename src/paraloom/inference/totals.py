"""Cumulative counts and nanoseconds of each model version a pool ran: what Triton's
statistics extension reports (``paraloom.serving`` answers ``GET /v2/models/{name}/stats``
and gRPC ``ModelStatistics`` from them; ``perf_analyzer`` reads their differences).

A batch's time is cut in three at the forward pass: ``compute_input`` (merging the requests'
rows and moving them to the replica's device), ``compute_infer`` (the forward pass) and
``compute_output`` (moving the output back, splitting it by request, numpy conversion). On
CUDA the forward pass returns before the device has finished, so the wait for it is in
``compute_output``. As in Triton, each answered request adds its batch's three times to the
per-request totals (so their mean is a request's compute time), and each batch adds them once
to the totals of its size (``batches``).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TypedDict

__all__ = ["VERSIONS_KEPT", "BatchTotals", "Duration", "Phases", "TotalsRecorder",
           "VersionTotals"]

VERSIONS_KEPT = 16
"""Versions whose totals are kept: the latest."""


class Duration(TypedDict):
    """A count and the nanoseconds they took together (Triton's ``StatisticDuration``)."""

    count: int
    ns: int


class BatchTotals(TypedDict):
    """The forward passes of one batch size: how many, and their phases' total time."""

    batch_size: int
    compute_input: Duration
    compute_infer: Duration
    compute_output: Duration


class VersionTotals(TypedDict):
    """What one model version has done since the pool started (see the module doc)."""

    version: int
    last_inference_ms: int
    """When its last batch was answered, in milliseconds since the epoch (0: never)."""
    inference_count: int
    """Rows of the requests answered with an output."""
    execution_count: int
    """Forward passes that answered requests (a failed batch's pass is not counted; each of
    its requests then runs alone, and those that succeed are)."""
    queue: Duration
    """Answered requests, and their time from arrival to their batch's start."""
    compute_input: Duration
    compute_infer: Duration
    compute_output: Duration
    batches: list[BatchTotals]
    """By batch size (rows), smallest first."""


@dataclass(frozen=True)
class Phases:
    """A batch's three phases, in seconds (see the module doc)."""

    input_s: float
    infer_s: float
    output_s: float

    def plus_output(self, seconds: float) -> Phases:
        """These phases with ``seconds`` more of output work (the numpy conversion)."""
        return Phases(self.input_s, self.infer_s, self.output_s + seconds)

    def nanoseconds(self) -> list[int]:
        """Input, infer and output, in whole nanoseconds."""
        return [_ns(self.input_s), _ns(self.infer_s), _ns(self.output_s)]


class _Sums:
    """One version's running sums (``VersionTotals`` without the copying)."""

    def __init__(self) -> None:
        self.last_ms = 0
        self.rows = 0
        self.executions = 0
        self.requests = 0
        self.queue_ns = 0
        self.phase_ns = [0, 0, 0]  # input, infer, output: per request
        self.by_size: dict[int, list[int]] = {}  # rows: [count, input, infer, output ns]


def _ns(seconds: float) -> int:
    return max(0, round(seconds * 1e9))


class TotalsRecorder:
    """Thread-safe totals of the latest ``VERSIONS_KEPT`` versions (bounded)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._versions: dict[int, _Sums] = {}

    def answered(self, version: int, batch_rows: int, rows: int,
                 queue_seconds: list[float], phases: Phases) -> None:
        """Record one forward pass of ``version`` over ``batch_rows`` rows, and the requests
        it answered: ``rows`` rows in all, each one's time in the queue; the batch's phases."""
        ns = phases.nanoseconds()
        answered = len(queue_seconds)
        now_ms = time.time_ns() // 1_000_000
        with self._lock:
            sums = self._sums(version)
            sums.last_ms = now_ms
            sums.rows += rows
            sums.executions += 1
            sums.requests += answered
            sums.queue_ns += sum(_ns(s) for s in queue_seconds)
            for i in range(3):
                sums.phase_ns[i] += ns[i] * answered
            size = sums.by_size.setdefault(batch_rows, [0, 0, 0, 0])
            size[0] += 1
            for i in range(3):
                size[i + 1] += ns[i]

    def unanswered(self, version: int, rows: int, queue_seconds: float, phases: Phases
                   ) -> None:
        """Take back one request that ``answered`` counted but that ended otherwise (its
        timeout settled it first): its rows, its queue time and its share of the phases. The
        forward pass stays counted."""
        ns = phases.nanoseconds()
        with self._lock:
            sums = self._versions.get(version)
            if sums is None:
                return
            sums.rows -= rows
            sums.requests -= 1
            sums.queue_ns -= _ns(queue_seconds)
            for i in range(3):
                sums.phase_ns[i] -= ns[i]

    def _sums(self, version: int) -> _Sums:
        sums = self._versions.get(version)
        if sums is None:
            sums = self._versions[version] = _Sums()
            while len(self._versions) > VERSIONS_KEPT:
                del self._versions[min(self._versions)]
        return sums

    def of(self, version: int) -> VersionTotals:
        """A copy of ``version``'s totals, taken now (zeros for a version that has not run)."""
        with self._lock:
            sums = self._versions.get(version, _Sums())
            n = sums.requests
            sizes = sorted((rows, list(v)) for rows, v in sums.by_size.items())
            totals: VersionTotals = {
                "version": version, "last_inference_ms": sums.last_ms,
                "inference_count": sums.rows, "execution_count": sums.executions,
                "queue": {"count": n, "ns": sums.queue_ns},
                "compute_input": {"count": n, "ns": sums.phase_ns[0]},
                "compute_infer": {"count": n, "ns": sums.phase_ns[1]},
                "compute_output": {"count": n, "ns": sums.phase_ns[2]},
                "batches": [],
            }
        for rows, (count, input_ns, infer_ns, output_ns) in sizes:
            totals["batches"].append({
                "batch_size": rows, "compute_input": {"count": count, "ns": input_ns},
                "compute_infer": {"count": count, "ns": infer_ns},
                "compute_output": {"count": count, "ns": output_ns}})
        return totals
