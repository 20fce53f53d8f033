"""Deadlines of ``submit()``'s queued requests: failed on time, not when a worker frees up.

``output()`` and ``output_async()`` wait for their own request and drop it at its deadline;
a Future from ``submit()`` has no waiter in the pool, so one thread (started at the first
``submit`` with a timeout) takes each expired request out of the queue and fails it with
``RequestTimeoutError``. A request a worker already took is left to finish.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any

from paraloom.inference.batching import Request, RequestQueue
from paraloom.inference.errors import RequestTimeoutError
from paraloom.inference.stats import StatsRecorder

__all__ = ["Deadlines", "expire", "give_back", "timeout_error"]

_COMPACT_AT = 4096  # heap entries before answered ones are dropped (then twice the live ones)


class _Ticket:
    """A queued request as the deadline heap holds it; emptied once its Future is done, so the
    heap never keeps an answered request's tensors alive until its deadline."""

    __slots__ = ("request",)

    def __init__(self, request: Request) -> None:
        self.request: Request | None = request

    def clear(self, _future: object = None) -> None:
        self.request = None


class Deadlines:
    """A daemon thread that calls ``expire(request)`` at each watched request's deadline."""

    def __init__(self, expire: Callable[[Request], None], name: str) -> None:
        self._expire = expire
        self._name = name
        self._heap: list[tuple[float, int, _Ticket]] = []
        self._order = itertools.count()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._compact_at = _COMPACT_AT

    def watch(self, request: Request) -> None:
        """Expire ``request`` at its deadline unless its Future is done by then."""
        assert request.deadline is not None
        ticket = _Ticket(request)
        with self._cond:
            if self._closed:
                return
            heapq.heappush(self._heap, (request.deadline, next(self._order), ticket))
            if len(self._heap) >= self._compact_at:
                self._compact()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify()
        add_done_callback = getattr(request.future, "add_done_callback", None)
        if add_done_callback is not None:
            add_done_callback(ticket.clear)

    def _compact(self) -> None:
        """Drop the answered requests' entries (with long timeouts they would pile up)."""
        self._heap = [entry for entry in self._heap if entry[2].request is not None]
        heapq.heapify(self._heap)
        self._compact_at = max(_COMPACT_AT, 2 * len(self._heap))

    def _due(self) -> list[Request] | None:
        """Wait for the next deadline; the requests due then (None once closed)."""
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                due = []
                while self._heap and self._heap[0][0] <= now:
                    request = heapq.heappop(self._heap)[2].request
                    if request is not None:
                        due.append(request)
                if due:
                    return due
                self._cond.wait(self._heap[0][0] - now if self._heap else None)
            return None

    def _run(self) -> None:
        while (due := self._due()) is not None:
            for request in due:
                self._expire(request)

    def close(self, timeout: float | None = None) -> None:
        """Stop the thread (the pool's close fails what is still queued)."""
        with self._cond:
            self._closed = True
            self._heap.clear()
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)


def timeout_error(request: Request) -> RequestTimeoutError:
    """The error of a request that ran past its timeout."""
    budget = (request.deadline or request.arrival) - request.arrival
    return RequestTimeoutError(
        f"no output within the request's timeout ({budget:.3g} s); pass a longer timeout, "
        "add workers, or send fewer requests at once")


def give_back(queue: RequestQueue, stats: StatsRecorder, request: Request,
               future: Future[Any]) -> None:
    """A submitted request's future is done: if it was cancelled while queued, leave the queue."""
    if future.cancelled() and queue.discard(request):
        stats.dropped("cancelled")  # else a worker took it: it counts the cancel


def expire(queue: RequestQueue, stats: StatsRecorder, request: Request) -> None:
    """Fail a submitted request at its deadline: one still queued is taken out, one running
    is settled now (its output, when the worker has it, is dropped), as ``output()`` does."""
    if not queue.discard(request):
        future = request.future  # a submit()'s; a worker that took it, not yet claimed, checks
        if isinstance(future, Future) and future.running():
            try:
                future.set_exception(timeout_error(request))
            except InvalidStateError:
                return  # it finished just in time
            stats.dropped("timeout")
        return
    if request.future.set_running_or_notify_cancel():
        waited = time.monotonic() - request.arrival
        request.future.set_exception(RequestTimeoutError(
            f"the request waited {waited:.3f} s in the queue, past its timeout; pass a "
            "longer timeout, add workers, or send fewer requests at once"))
        stats.dropped("timeout")
    else:
        stats.dropped("cancelled")
