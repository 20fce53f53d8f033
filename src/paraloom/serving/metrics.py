"""Prometheus metrics of one server: requests, failures by reason, latency, queue and forward time.

Each app owns its own ``CollectorRegistry`` (no process-global state), so two apps in one process,
or one test after another, never see each other's counts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Literal

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

__all__ = ["CONTENT_TYPE_LATEST", "PoolCollector", "ServingMetrics"]

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

    def request(self, model: str) -> None:
        """Count one inference request."""
        self.requests.labels(model).inc()

    def failure(self, model: str, reason: str) -> None:
        """Count one failed request under ``reason`` (bad_request, queue_full, ...)."""
        self.failures.labels(model, reason).inc()

    def done(self, model: str, seconds: float) -> None:
        """Record the server-side latency of one answered request."""
        self.latency.labels(model).observe(seconds)

    def watch(self, pools: Callable[[], Mapping[str, ParallelInference]],
              versions: Callable[[], Mapping[str, int]] | None = None) -> None:
        """Export each pool's ``stats()`` (queue and forward time, batch sizes, ...) at each
        scrape; ``pools()`` gives the pools serving then, by model name, and ``versions()`` the
        version each serves (default: the pool's ``model_version``)."""
        self.registry.register(PoolCollector(pools, versions))

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)


class PoolCollector:
    """Reads the serving pools' ``stats()`` when Prometheus scrapes, and exports them."""

    def __init__(self, pools: Callable[[], Mapping[str, ParallelInference]],
                 versions: Callable[[], Mapping[str, int]] | None = None) -> None:
        self.pools = pools
        self.versions = versions

    def describe(self) -> list[Metric]:
        """Nothing up front: the registry must not call ``stats()`` when this is registered."""
        return []

    def collect(self) -> Iterator[Metric]:
        """The metric families, one sample per model, from one ``stats()`` call per pool."""
        stats = {m: p.stats() for m, p in self.pools().items()}
        if self.versions is not None:  # a pool counts from 1; the server's versions may not
            served = self.versions()
            stats = {m: _with_version(s, served.get(m, s.get("model_version", 0)))
                     for m, s in stats.items()}
        yield from self._counters(stats)
        yield self._batch_sizes(stats)
        yield self._timing(stats, "queue_time_ms", "queue", "Time requests waited in the queue")
        yield self._timing(stats, "forward_time_ms", "forward",
                           "Time of each batched forward pass")
        for key, name, help_text in _GAUGES:
            gauge = GaugeMetricFamily(f"paraloom_{name}", help_text, labels=["model"])
            for model, s in stats.items():
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


def _with_version(stats: InferenceStats, version: int) -> InferenceStats:
    """A copy of a pool's stats with ``model_version`` the version the server serves."""
    copied = stats.copy()
    copied["model_version"] = version
    return copied
