"""Triton's statistics extension: each served model version's counts and cumulative times.

``GET /v2/models[/{name}[/versions/{version}]]/stats`` and gRPC ``ModelStatistics`` answer
with Triton's ``model_stats`` objects, so ``tritonclient``'s ``get_inference_statistics`` and
``perf_analyzer``'s server-side breakdown read them unchanged. Per model version, since it was
loaded (never reset):

- ``inference_stats.success`` / ``fail``: the requests answered with an output / an error, and
  their time in the server, from reading the request to its answer (a failure counts once the
  model and version are found: an unknown model's 404 does not);
- ``queue``, ``compute_input``, ``compute_infer``, ``compute_output``: the pool's totals of the
  answered requests (``paraloom.inference.totals``: each request adds its batch's phases);
- ``batch_stats``: the forward passes of each batch size; ``inference_count`` (rows answered),
  ``execution_count`` (forward passes) and ``last_inference`` (ms since the epoch).

``cache_hit`` and ``cache_miss`` are zeros (there is no response cache), as are
``memory_usage`` and ``response_stats`` (no decoupled models). Each server process counts its
own requests (``serve --processes N``: each answers with its own counts).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, TypedDict

from paraloom.inference.totals import VERSIONS_KEPT, Duration, TotalsRecorder, VersionTotals

if TYPE_CHECKING:
    from paraloom.serving.repository.models import ModelRepository
    from paraloom.serving.served import ServedModel

__all__ = ["RequestTotals", "StatisticsResponse", "model_statistics", "statistics"]

_ZERO: Duration = {"count": 0, "ns": 0}


class StatisticsResponse(TypedDict):
    """Triton's statistics response: ``{"model_stats": [one object per model version]}``."""

    model_stats: list[dict[str, Any]]


class RequestTotals:
    """The requests one served model answered, by version: how many succeeded and failed,
    and their time in the server (thread-safe; the latest 16 versions are kept)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._versions: dict[str, list[int]] = {}  # version: [ok, ok ns, failed, failed ns]

    def succeeded(self, version: str, seconds: float) -> None:
        """Count one request of ``version`` answered with an output after ``seconds``."""
        self._add(version, 0, seconds)

    def failed(self, version: str, seconds: float) -> None:
        """Count one request of ``version`` answered with an error after ``seconds``."""
        self._add(version, 2, seconds)

    def _add(self, version: str, at: int, seconds: float) -> None:
        with self._lock:
            sums = self._versions.get(version)
            if sums is None:
                sums = self._versions[version] = [0, 0, 0, 0]
                if len(self._versions) > VERSIONS_KEPT:
                    del self._versions[next(iter(self._versions))]
            sums[at] += 1
            sums[at + 1] += max(0, round(seconds * 1e9))

    def of(self, version: str) -> tuple[Duration, Duration]:
        """The successes and failures of ``version`` (zeros if none), copied now."""
        with self._lock:
            ok, ok_ns, failed, failed_ns = self._versions.get(version, [0, 0, 0, 0])
        return {"count": ok, "ns": ok_ns}, {"count": failed, "ns": failed_ns}


def _pool_totals(served: ServedModel) -> VersionTotals:
    """The pool's totals of the version ``served`` serves now (zeros from a pool of the
    caller's that keeps none)."""
    totals = getattr(served.pool, "totals", None)
    if totals is None:
        return TotalsRecorder().of(served.pool.model_version)
    found: VersionTotals = totals()
    return found


def model_statistics(served: ServedModel) -> dict[str, Any]:
    """Triton's statistics object of the version ``served`` serves now."""
    pool = _pool_totals(served)
    success, fail = served.outcomes.of(served.version)
    return {
        "name": served.name, "version": served.version,
        "last_inference": pool["last_inference_ms"],
        "inference_count": pool["inference_count"], "execution_count": pool["execution_count"],
        "inference_stats": {
            "success": success, "fail": fail, "queue": pool["queue"],
            "compute_input": pool["compute_input"], "compute_infer": pool["compute_infer"],
            "compute_output": pool["compute_output"], "cache_hit": _ZERO, "cache_miss": _ZERO},
        "batch_stats": [dict(b) for b in pool["batches"]],
        "memory_usage": [], "response_stats": {},
    }


def statistics(repository: ModelRepository, name: str | None = None,
               version: str | None = None) -> StatisticsResponse:
    """The statistics of every version of every loaded model (``name`` None), of every
    version of ``name`` (``version`` None), or of that one version; ``NotFoundError`` for a
    model or version not served, as for its metadata."""
    if name is None:
        served = repository.every()
    elif version is None:
        served = repository.get(name).siblings
    else:
        served = [repository.get(name, version)]
    return {"model_stats": [model_statistics(s) for s in served]}
