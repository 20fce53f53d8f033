"""Prometheus metrics of one server: requests, failures by reason, latency, queue and forward time.

Each app owns its own ``CollectorRegistry`` (no process-global state), so two apps in one process,
or one test after another, never see each other's counts.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Literal, TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

if TYPE_CHECKING:
    from paraloom.inference.parallel import ParallelInference
    from paraloom.inference.stats import InferenceStats, Percentiles

__all__ = ["CONTENT_TYPE_LATEST", "PoolCollector", "Served", "ServingMetrics"]

_K = TypeVar("_K")
Served = tuple["ParallelInference", int]
"""A pool serving a model, and the version it serves."""

# Latencies of a CPU model served over HTTP run from ~100 us to seconds.
_SECONDS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
            1.0, 2.5, 5.0, 10.0)
_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_QUANTILES: tuple[tuple[Literal["p50", "p90", "p99", "max"], str], ...] = (
    ("p50", "0.5"), ("p90", "0.9"), ("p99", "0.99"), ("max", "1"))
_COUNTERS: tuple[tuple[Literal["requests", "completed", "failed", "rows", "batches"], str], ...] = (
    ("requests", "Requests ParallelInference accepted."),
    ("completed", "Requests answered with an output."),
    ("failed", "Accepted requests answered with an error."),
    ("rows", "Rows run through the model."),
    ("batches", "Forward passes."))
_GAUGES: tuple[tuple[Literal["model_version", "queued"], str, str], ...] = (
    ("model_version", "model_version", "Version of the model now served."),
    ("queued", "queue_length", "Requests waiting now."))


class ServingMetrics:
    """The server's counters and histograms, labelled by model name."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter("paraloom_inference_requests", "Inference requests received.",
                                ["model"], registry=r)
        self.failures = Counter("paraloom_inference_failures",
                                "Inference requests that failed, by reason.",
                                ["model", "reason"], registry=r)
        self.latency = Histogram("paraloom_request_duration_seconds",
                                 "Time from reading a request to its answer, in the server.",
                                 ["model"], buckets=_SECONDS, registry=r)
        self._pools: PoolCollector | None = None  # set by watch()

    def request(self, model: str) -> None:
        """Count one inference request."""
        self.requests.labels(model).inc()

    def failure(self, model: str, reason: str) -> None:
        """Count one failed request under ``reason`` (bad_request, queue_full, ...)."""
        self.failures.labels(model, reason).inc()

    def done(self, model: str, seconds: float) -> None:
        """Record the server-side latency of one answered request."""
        self.latency.labels(model).observe(seconds)

    def watch(self, pools: Callable[[], Mapping[str, Sequence[Served]]]) -> None:
        """Export the pools' ``stats()`` (queue and forward time, batch sizes, ...) at each
        scrape; ``pools()`` gives, by model name, each version served then as (pool, version),
        latest last. Call ``retired`` with a pool the server closed, so that its model's
        counters keep counting what it did."""
        self._pools = PoolCollector(pools)
        self.registry.register(self._pools)

    def retired(self, model: str, pool: ParallelInference) -> None:
        """Carry ``pool``'s counts (closed: a replaced or unloaded version) into ``model``'s
        counters, so that they never go down when a load serves a new pool."""
        if self._pools is not None:
            self._pools.retired(model, pool.stats())

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)


class PoolCollector:
    """Reads the serving pools' ``stats()`` when Prometheus scrapes, and exports them by model:
    counters summed over every pool that has served the model (the closed ones' carried), the
    recent timings of its latest version's pool, the queue of all its pools."""

    def __init__(self, pools: Callable[[], Mapping[str, Sequence[Served]]]) -> None:
        self.pools = pools
        self._carried: dict[str, InferenceStats] = {}  # closed pools' counts, by model
        self._lock = threading.Lock()  # retired() runs on the event loop, collect() anywhere

    def describe(self) -> list[Metric]:
        """Nothing up front: the registry must not call ``stats()`` when this is registered."""
        return []

    def retired(self, model: str, stats: InferenceStats) -> None:
        """Add a closed pool's final ``stats`` to ``model``'s carried counts."""
        with self._lock:
            carried = self._carried.get(model)
            self._carried[model] = stats if carried is None else _summed(carried, stats)

    def collect(self) -> Iterator[Metric]:
        """The metric families, one sample per model, from one ``stats()`` call per pool."""
        served = self.pools()
        with self._lock:
            totals = dict(self._carried)
        latest: dict[str, InferenceStats] = {}  # the gauges: the latest version's pool
        for model, versions in served.items():
            for pool, version in versions:
                stats = pool.stats()
                totals[model] = stats if model not in totals else _summed(totals[model], stats)
                queued = latest[model]["queued"] if model in latest else 0
                latest[model] = {**stats, "model_version": version,
                                 "queued": queued + stats.get("queued", 0)}
        yield from self._counters(totals)
        yield self._batch_sizes(totals)
        yield self._timing(latest, "queue_time_ms", "queue", "Time requests waited in the queue")
        yield self._timing(latest, "forward_time_ms", "forward",
                           "Time of each batched forward pass")
        for key, name, help_text in _GAUGES:
            gauge = GaugeMetricFamily(f"paraloom_{name}", help_text, labels=["model"])
            for model, s in latest.items():
                gauge.add_metric([model], float(s.get(key, 0)))
            yield gauge

    # Each reads by key name, with a default for any key a pool leaves out.

    def _counters(self, stats: Mapping[str, InferenceStats]) -> Iterator[Metric]:
        for key, help_text in _COUNTERS:
            family = CounterMetricFamily(f"paraloom_pool_{key}", help_text, labels=["model"])
            for model, s in stats.items():
                family.add_metric([model], float(s.get(key, 0)))
            yield family
        rejected = CounterMetricFamily("paraloom_pool_rejections",
                                       "Requests ParallelInference refused or dropped, by reason.",
                                       labels=["model", "reason"])
        for model, s in stats.items():
            for reason, count in sorted(s.get("rejections", {}).items()):
                rejected.add_metric([model, reason], float(count))
        yield rejected

    def _batch_sizes(self, stats: Mapping[str, InferenceStats]) -> Metric:
        family = HistogramMetricFamily("paraloom_batch_size", "Rows in each forward pass.",
                                       labels=["model"])
        for model, s in stats.items():
            histogram = s.get("batch_size_histogram", {})
            buckets = []
            for bound in _SIZES:  # Prometheus buckets are cumulative: batches of <= bound rows
                seen = sum(n for size, n in histogram.items() if int(size) <= bound)
                buckets.append((str(float(bound)), float(seen)))
            buckets.append(("+Inf", float(sum(histogram.values()))))
            family.add_metric([model], buckets, sum_value=float(s.get("rows", 0)))
        return family

    def _timing(self, stats: Mapping[str, InferenceStats],
                key: Literal["queue_time_ms", "forward_time_ms"], name: str, what: str
                ) -> Metric:
        family = GaugeMetricFamily(
            f"paraloom_{name}_time_seconds",
            f"{what}, over the pool's recent window, by quantile (1: the maximum).",
            labels=["model", "quantile"])
        for model, s in stats.items():
            summary: Percentiles | dict[str, float] = s.get(key, {})
            for k, quantile in _QUANTILES:
                family.add_metric([model, quantile], summary.get(k, 0.0) / 1e3)
        return family


def _summed(a: InferenceStats, b: InferenceStats) -> InferenceStats:
    """``a`` with ``b``'s counters, rejections and batch sizes added."""
    out = a.copy()
    for key, _ in _COUNTERS:
        out[key] = a.get(key, 0) + b.get(key, 0)
    out["rejections"] = _added(a.get("rejections", {}), b.get("rejections", {}))
    out["batch_size_histogram"] = _added(a.get("batch_size_histogram", {}),
                                         b.get("batch_size_histogram", {}))
    return out


def _added(a: Mapping[_K, int], b: Mapping[_K, int]) -> dict[_K, int]:
    return {k: a.get(k, 0) + b.get(k, 0) for k in {*a, *b}}
