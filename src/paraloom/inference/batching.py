"""The bounded request queue and batch collection (pure: no torch, no threads of its own).

Requests are grouped by their batch *key* (structure, shapes after the first dimension, dtypes,
devices), so requests of different shapes never block each other. A free worker calls
:meth:`RequestQueue.take`: it gets the group whose oldest request arrived first, merged up to
``batch_rows`` rows in arrival order. With ``max_wait > 0`` the worker keeps the batch open until
it is full or ``max_wait`` seconds have passed since its oldest request arrived (monotonic
clock); with ``max_wait == 0`` (the default) it takes what is queued at once, so batches grow only
while every worker is busy and an idle pool adds no latency.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

from paraloom.inference.errors import InferenceClosedError, QueueFullError

if TYPE_CHECKING:
    import torch

__all__ = ["FutureLike", "Request", "RequestQueue"]


class FutureLike(Protocol):
    """The part of a ``concurrent.futures.Future`` that workers and waiters use.

    A ``Future`` has it, and so has the cheaper ``Pending`` of blocking ``output()`` calls.
    """

    def set_running_or_notify_cancel(self) -> bool: ...

    def set_result(self, value: object, /) -> None: ...

    def set_exception(self, error: BaseException, /) -> None: ...

    def cancel(self) -> bool: ...

    def done(self) -> bool: ...

    def cancelled(self) -> bool: ...

    def result(self, timeout: float | None = None) -> Any: ...


class Request:
    """One caller's request: its input, batch key, row count, timing and future.

    ``future`` is a ``concurrent.futures.Future`` (``submit``) or a cheaper ``Pending``
    (``output``); workers use only the methods both have (:class:`FutureLike`).
    """

    __slots__ = ("tensors", "spec", "rows", "key", "numpy", "future", "arrival", "deadline",
                 "with_version")

    def __init__(self, tensors: tuple[torch.Tensor, ...], spec: Hashable, rows: int,
                 key: Hashable, *, numpy: bool = False, future: FutureLike | None = None,
                 arrival: float = 0.0, deadline: float | None = None,
                 with_version: bool = False) -> None:
        self.tensors = tensors
        self.spec = spec
        self.rows = rows
        self.key = key
        self.numpy = numpy
        self.future: FutureLike = future if future is not None else Future()
        self.arrival = arrival
        self.deadline = deadline
        self.with_version = with_version


class RequestQueue:
    """A queue of at most ``limit`` requests that hands out batches of one key.

    ``batch_rows=None`` hands out one request at a time (sequential mode). All waits are on
    conditions with the remaining monotonic time; :meth:`close` wakes every waiter.
    """

    def __init__(self, *, limit: int, batch_rows: int | None = None, max_wait: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if limit < 1:
            raise ValueError(f"limit={limit}; expected >= 1")
        if batch_rows is not None and batch_rows < 1:
            raise ValueError(f"batch_rows={batch_rows}; expected >= 1 or None")
        if max_wait < 0:
            raise ValueError(f"max_wait={max_wait}; expected >= 0 seconds")
        self.limit = limit
        self.batch_rows = batch_rows
        self.max_wait = max_wait
        self._clock = clock
        self._lock = threading.Lock()
        self._not_empty = threading.Condition(self._lock)
        self._not_full = threading.Condition(self._lock)
        self._groups: dict[Hashable, deque[Request]] = {}
        self._group_rows: dict[Hashable, int] = {}
        self._size = 0
        self._closed = False
        self._why_closed = _CLOSED

    def __len__(self) -> int:
        return self._size

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called: no request is accepted any more."""
        return self._closed

    def put(self, request: Request, *, block: bool = True, timeout: float | None = None) -> None:
        """Queue a request; when full, wait up to ``timeout`` (``block=False``: fail at once)."""
        with self._lock:
            if not self._closed and self._size >= self.limit:
                self._wait_for_room(block, timeout)
            if self._closed:
                raise InferenceClosedError(self._why_closed)
            group = self._groups.get(request.key)
            if group is None:
                group = self._groups[request.key] = deque()
                self._group_rows[request.key] = 0
            group.append(request)
            self._group_rows[request.key] += request.rows
            self._size += 1
            if self.max_wait > 0:
                self._not_empty.notify_all()  # a worker holding a batch open may now fill it
            else:
                self._not_empty.notify()

    def _wait_for_room(self, block: bool, timeout: float | None) -> None:
        if not block or (timeout is not None and timeout <= 0):
            raise self._full_error(None if not block else timeout)
        deadline = None if timeout is None else self._clock() + timeout
        while self._size >= self.limit and not self._closed:
            remaining = None if deadline is None else deadline - self._clock()
            if remaining is not None and remaining <= 0:
                raise self._full_error(timeout)
            self._not_full.wait(remaining)

    def _full_error(self, timeout: float | None) -> QueueFullError:
        waited = "without waiting (block=False)" if timeout is None else f"for {timeout:.3g} s"
        return QueueFullError(
            f"the request queue is full: it holds queue_limit={self.limit} requests and none "
            f"left it {waited}. Retry later, or raise queue_limit, add workers, or pass a "
            "longer timeout")

    def take(self, timeout: float | None = None) -> list[Request]:
        """Wait up to ``timeout`` for requests and return the next batch (``[]`` if none came)."""
        deadline = None if timeout is None else self._clock() + timeout
        with self._lock:
            while True:
                wait: float | None
                if self._size:
                    key, wait = self._next_group()
                    if key is not None:
                        return self._pop(key)
                elif self._closed:
                    return []
                else:
                    wait = None if deadline is None else deadline - self._clock()
                    if wait is not None and wait <= 0:
                        return []
                self._not_empty.wait(wait)

    def _next_group(self) -> tuple[Hashable | None, float]:
        """The group to take now: the oldest of those whose batch is ready (full, or held open
        long enough); else None and the seconds until the first is ready."""
        if len(self._groups) == 1 or self._closed or self.max_wait <= 0:
            key = self._oldest_key()
            wait = 0.0 if self._closed else self._fill_time(key)
            return (key, 0.0) if wait <= 0 else (None, wait)
        waits = {key: self._fill_time(key) for key in self._groups}
        ready = [key for key, wait in waits.items() if wait <= 0]
        if ready:
            return min(ready, key=lambda k: self._groups[k][0].arrival), 0.0
        return None, min(waits.values())

    def _oldest_key(self) -> Hashable:
        if len(self._groups) == 1:
            return next(iter(self._groups))
        return min(self._groups, key=lambda k: self._groups[k][0].arrival)

    def _fill_time(self, key: Hashable) -> float:
        """Seconds to keep this group's batch open for more requests (0: take it now): up to
        ``max_wait`` after its first request came, and at most half of any of its requests'
        timeouts (held open longer, it would time out in the queue)."""
        if self.max_wait <= 0 or self.batch_rows is None:
            return 0.0
        if self._group_rows[key] >= self.batch_rows:
            return 0.0
        group = self._groups[key]
        start = group[0].arrival + self.max_wait
        for request in group:
            if request.deadline is not None:
                start = min(start, (request.arrival + request.deadline) / 2)
        return start - self._clock()

    def _pop(self, key: Hashable) -> list[Request]:
        group = self._groups[key]
        first = group.popleft()
        batch, rows = [first], first.rows
        if self.batch_rows is not None:
            limit = self.batch_rows
            while group and rows + group[0].rows <= limit:
                request = group.popleft()
                rows += request.rows
                batch.append(request)
        self._forget(key, group, rows, len(batch))
        if self._size:
            self._not_empty.notify()  # pass the wake-up on: other groups wait for a free worker
        return batch

    def _forget(self, key: Hashable, group: deque[Request], rows: int, count: int) -> None:
        if group:
            self._group_rows[key] -= rows
        else:
            del self._groups[key]
            del self._group_rows[key]
        self._size -= count
        self._not_full.notify(count)

    def discard(self, request: Request) -> bool:
        """Remove a queued request (cancelled or timed out); False if it was not queued."""
        with self._lock:
            group = self._groups.get(request.key)
            if group is None:
                return False
            try:
                group.remove(request)
            except ValueError:
                return False
            self._forget(request.key, group, request.rows, 1)
            return True

    def close(self, why: str | None = None) -> None:
        """Accept no more requests and wake every waiter; queued requests stay to be taken.
        ``why``: what a request refused from now on is told (default: the pool was closed)."""
        with self._lock:
            if not self._closed and why is not None:
                self._why_closed = why
            self._closed = True
            self._not_empty.notify_all()
            self._not_full.notify_all()

    def clear(self) -> list[Request]:
        """Remove and return every queued request, oldest first."""
        with self._lock:
            requests = [r for group in self._groups.values() for r in group]
            requests.sort(key=lambda r: r.arrival)
            self._groups.clear()
            self._group_rows.clear()
            self._size = 0
            self._not_full.notify_all()
            return requests


_CLOSED = ("this ParallelInference is closed and accepts no more requests; create a new one "
           "(or call output() before close())")
