"""What Spark tasks share inside one executor Python process: a model cache, thread settings.

Spark reuses an executor's Python processes between tasks (``spark.python.worker.reuse``, on by
default), so a model built for one task can serve the next ones of the same job, as
``predict_batch_udf``'s ``ModelCache`` does. Keys are chosen by the caller (a job or fit id
plus a state digest).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar, cast

import torch

if TYPE_CHECKING:
    from pyspark import TaskContext

__all__ = ["cached", "task_threads", "clear_cache", "gpu_addresses", "peak_rss", "reset_peak_rss"]

T = TypeVar("T")
_CAPACITY = 4
_CACHE: OrderedDict[str, object] = OrderedDict()
_LOCK = threading.Lock()


def cached(key: str, build: Callable[[], T]) -> T:
    """The object cached under ``key`` in this Python process, built on first use (LRU of 4)."""
    with _LOCK:
        if key in _CACHE:
            _CACHE.move_to_end(key)
            return cast(T, _CACHE[key])  # the key names what was built: the caller's T
    value = build()
    with _LOCK:
        _CACHE[key] = value
        _CACHE.move_to_end(key)
        while len(_CACHE) > _CAPACITY:
            _CACHE.popitem(last=False)
    return value


def clear_cache() -> None:
    """Forget every cached object (tests; or to free memory in a long-lived worker)."""
    with _LOCK:
        _CACHE.clear()


def _task_context() -> TaskContext | None:
    try:
        from pyspark import TaskContext
    except ImportError:  # not inside Spark (unit tests)
        return None
    return TaskContext.get()


def task_threads(threads: int | None = None) -> int:
    """Set torch's intra-op threads to ``threads``, else the task's CPUs (``spark.task.cpus``)."""
    if threads is None:
        context = _task_context()
        threads = int(context.cpus()) if context is not None else torch.get_num_threads()
    threads = max(1, int(threads))
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads


def gpu_addresses() -> list[str]:
    """The GPU addresses Spark assigned to this task (``spark.task.resource.gpu.amount``)."""
    context = _task_context()
    if context is None:
        return []
    info = context.resources().get("gpu")
    return list(info.addresses) if info is not None else []


def reset_peak_rss() -> bool:
    """Start this process's peak-memory count afresh (Linux: ``/proc/self/clear_refs``), so
    that a reused Python process reports one task's peak, not its earlier tasks'. Returns
    whether it could."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss() -> int:
    """This process's peak resident memory in bytes: since the last ``reset_peak_rss`` on
    Linux (``VmHWM``), else since the process started (a reused Python process then counts its
    earlier tasks too)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)
