"""ParallelInference: thread-safe inference over a pool of model replicas (DL4J's, done again).

Stable API, used by ``paraloom.serving``:

* ``submit(x, block=True, timeout=None, return_version=False)`` -> ``concurrent.futures.Future``
* ``output(x, ...)`` (blocking) and ``await output_async(x, ...)`` (asyncio)
* ``update_model(model, example_input=None)`` -> the new ``model_version`` (an int, from 1)
* ``stats()`` -> dict (keys in :mod:`paraloom.inference.stats`)
* ``close(drain=True, timeout=None)``, alias ``shutdown``
* errors (:mod:`paraloom.inference.errors`): ``QueueFullError``, ``InvalidRequestError``,
  ``RequestTimeoutError``, ``InferenceClosedError``, ``ModelUpdateError``, ``InferenceError``
"""

from __future__ import annotations

import asyncio
import enum
import functools
import threading
import time
import warnings
import weakref
from concurrent import futures
from concurrent.futures import Future, InvalidStateError
from typing import Any, Final

import torch
from torch import nn

from paraloom.devices import DeviceSpec, replica_devices
from paraloom.inference.batching import FutureLike, Request, RequestQueue
from paraloom.inference.config import InferenceConfig, InferenceMode, check_seconds
from paraloom.inference.deadlines import Deadlines, expire, give_back, timeout_error
from paraloom.inference.errors import (
    InferenceClosedError,
    ModelUpdateError,
    QueueFullError,
    RequestTimeoutError,
)
from paraloom.inference.execute import fail_requests, serve_batch_guarded
from paraloom.inference.payload import one_example, parse, with_keywords
from paraloom.inference.pending import Pending
from paraloom.inference.replicas import (
    Example,
    Generation,
    SlotPool,
    build_generation,
    example_of,
    warm_up,
)
from paraloom.inference.stats import InferenceStats, StatsRecorder
from paraloom.inference.totals import VersionTotals
from paraloom.inference.workers import TICK, WorkerThreads
from paraloom.precision import Precision, resolve_precision

__all__ = ["ParallelInference"]


class _Unset(enum.Enum):
    """The type of ``_UNSET``: "no timeout given, use the pool's default"."""

    UNSET = enum.auto()


_UNSET: Final = _Unset.UNSET
# One class from Python 3.11 on; three before.
_TIMEOUTS = (TimeoutError, asyncio.TimeoutError, futures.TimeoutError)


def _call_input(x: object, keywords: dict[str, object]) -> object:
    """``output()``'s input: a single example as one row (its keyword inputs too), plus the
    keyword inputs."""
    single = one_example(x)
    if single is not x:
        keywords = {k: one_example(v) for k, v in keywords.items()}
    return with_keywords(single, keywords)


class ParallelInference:
    """Run a model from many threads at once on replicas, batching concurrent requests.

    ``inference_mode``: ``"batched"`` (merge concurrent requests into batches of up to
    ``batch_limit`` rows), ``"sequential"`` (one request per forward pass, FIFO) or
    ``"inplace"`` (the caller's thread runs a free replica). ``workers`` replicas (default: one
    per device) are spread round robin over ``devices`` (``"auto"``: every CUDA device, else
    the CPU; ``"cpu"``, ``["cuda:0", "cuda:1"]``, a GPU count: as ParallelWrapper's).
    ``queue_limit`` caps the queued requests; ``timeout`` (seconds) is every request's default
    deadline;
    ``max_wait_ms`` lets a free worker wait for a fuller batch; ``precision`` takes Lightning's
    names; ``example_input`` warms every replica and validates the setup at construction;
    ``threads_per_worker`` sets torch's intra-op threads in each worker thread.
    """

    def __init__(self, model: nn.Module, *, inference_mode: InferenceMode | str = "batched",
                 workers: int | None = None, batch_limit: int = 32, queue_limit: int = 64,
                 max_wait_ms: float = 0.0, timeout: float | None = None,
                 devices: DeviceSpec = "auto", precision: str | Precision = "32-true",
                 example_input: object = None, threads_per_worker: int | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
        self._config = InferenceConfig.build(
            inference_mode=inference_mode, workers=workers, batch_limit=batch_limit,
            queue_limit=queue_limit, max_wait_ms=max_wait_ms, timeout=timeout,
            threads_per_worker=threads_per_worker)
        self._precision = resolve_precision(precision)
        self._devices = replica_devices(devices, self._config.workers)
        self._stats = StatsRecorder()
        self._swap_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._closed = False
        self._current = _Current(build_generation(model, 1, self._devices, self._precision,
                                                  merges=self._merges))
        if example_input is not None:
            self._warm(self._generation, self._example(example_input), "example_input")
        self._slots: SlotPool | None = None
        self._queue: RequestQueue | None = None
        self._workers: WorkerThreads | None = None
        self._deadlines: Deadlines | None = None
        if self._config.mode is InferenceMode.INPLACE:
            self._slots = SlotPool(len(self._devices), self._config.queue_limit)
        else:
            self._queue = RequestQueue(limit=self._config.queue_limit,
                                       batch_rows=self._config.batch_limit if self._merges
                                       else None,
                                       max_wait=self._config.max_wait)
            # The threads hold the pool's parts, never the pool: one dropped without close()
            # is collected, and its finalizer stops them (they kept it, its replicas and
            # their memory, for the life of the process).
            current, queue, stats = self._current, self._queue, self._stats
            self._workers = WorkerThreads(queue, self._devices, lambda: current.generation,
                                          stats, self._config.threads_per_worker)
            self._workers.start()
            self._deadlines = Deadlines(functools.partial(expire, queue, stats),
                                        "paraloom-inference-deadlines")
            weakref.finalize(self, _abandon, queue, self._workers, self._deadlines)

    @property
    def _generation(self) -> Generation:
        """The model version new batches run on (read once per batch)."""
        return self._current.generation

    @_generation.setter
    def _generation(self, generation: Generation) -> None:
        self._current.generation = generation  # one attribute write: each batch reads it once

    # ------------------------------------------------------------------ construction helpers

    def _example(self, example_input: object) -> Example:
        # As requests are: inputs never merged may have first dimensions other than the rows.
        parsed = parse(example_input, aligned=self._merges)
        return parsed.key, parsed.spec, parsed.tensors

    def _warm(self, generation: Generation, example: Example, what: str) -> None:
        try:
            warm_up(generation, example, merges=self._merges)
        except Exception as exc:
            raise ValueError(f"the model failed on {what} with precision="
                             f"{self._precision.name!r} on {self._devices[0]}: "
                             f"{type(exc).__name__}: {exc}. Check {what}'s shape and dtype, or "
                             "the precision") from exc

    @property
    def _merges(self) -> bool:
        return self._config.mode is InferenceMode.BATCHED

    # ------------------------------------------------------------------------ requests

    def _timeout_for(self, timeout: float | None | _Unset) -> float | None:
        if timeout is _UNSET:
            return self._config.timeout
        return check_seconds("timeout", timeout, allow_zero=False)

    def _make_request(self, x: object, timeout: float | None, with_version: bool,
                      future: FutureLike) -> Request:
        try:  # requests never merged (in place, sequential) may have inputs of any rows
            p = parse(x, aligned=self._merges)
        except Exception:
            self._stats.rejected("invalid")
            raise
        now = time.monotonic()
        return Request(p.tensors, p.spec, p.rows, p.key, numpy=p.numpy, future=future,
                       arrival=now, deadline=None if timeout is None else now + timeout,
                       with_version=with_version)

    def _enqueue(self, request: Request, block: bool) -> None:
        """Queue the request (or, in place, run it now), waiting for room up to its deadline."""
        remaining = None if request.deadline is None else request.deadline - time.monotonic()
        try:
            if self._slots is not None:
                self._run_inplace(request, block, remaining)
                return
            assert self._queue is not None
            self._queue.put(request, block=block, timeout=remaining)
        except QueueFullError:
            self._stats.rejected("queue_full")
            raise
        except RequestTimeoutError:  # in place: in line for a replica past its timeout
            self._stats.rejected("timeout")
            raise
        except InferenceClosedError:
            self._stats.rejected("closed")
            raise
        self._stats.accepted()

    def _run_inplace(self, request: Request, block: bool, timeout: float | None) -> None:
        assert self._slots is not None
        slot = self._slots.acquire(block=block, timeout=timeout)
        try:
            self._stats.accepted()
            with torch.inference_mode():
                serve_batch_guarded(self._generation, slot, [request], self._stats)
        finally:
            self._slots.release(slot)

    def submit(self, x: object, *, block: bool = True, timeout: float | None | _Unset = _UNSET,
               return_version: bool = False) -> Future[Any]:
        """Queue ``x`` and return a Future of its output (``(output, version)`` if asked).

        When the queue is full, waits up to ``timeout`` for room (``block=False``: raises
        QueueFullError at once). In 'inplace' mode the request runs before this returns.
        Cancelling the future while its request is queued takes the request out of the queue.
        The input is not copied: leave it unchanged until the future is done.
        """
        future: Future[Any] = Future()
        request = self._make_request(x, self._timeout_for(timeout), return_version, future)
        self._enqueue(request, block)
        if self._queue is not None:  # a cancelled future gives its place in the queue back
            # Not a bound method: a future's callback that held the pool would keep a dropped
            # pool, its threads and replicas, alive until a cyclic collection.
            future.add_done_callback(functools.partial(give_back, self._queue, self._stats,
                                                       request))
        if request.deadline is not None and self._deadlines is not None:
            self._deadlines.watch(request)  # no caller waits in the pool: fail it on time
        return future

    def output(self, x: object, *, timeout: float | None | _Unset = _UNSET,
               return_version: bool = False, **inputs: object) -> Any:
        """The model's output for ``x`` (thread-safe); ``(output, version)`` if asked.

        A single example (a list of numbers, a 1-D tensor or array) is one row, as DL4J's
        ``output(float[])``: the output has one row. Keyword inputs (masks) go to the model by
        name, batched with ``x``: ``output(x, mask=m)`` runs ``model(x, mask=m)``.
        """
        x = _call_input(x, inputs)
        request = self._make_request(x, self._timeout_for(timeout), return_version, Pending())
        self._enqueue(request, True)
        return self._wait(request)

    def _wait(self, request: Request) -> Any:
        fut = request.future
        while True:
            remaining = None if request.deadline is None else request.deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return self._timed_out(request)
            try:
                return fut.result(TICK if remaining is None else min(remaining, TICK))
            except _TIMEOUTS:
                if fut.done():  # its own error (a RequestTimeoutError from the worker), or an
                    return fut.result(0)  # outcome that came just after the wait timed out
                self._check_alive(fut)

    def _check_alive(self, fut: FutureLike) -> None:
        if self._workers is not None and not self._workers.alive():
            try:
                fut.set_exception(InferenceClosedError("every inference worker has stopped "
                                                       "before this request ran"))
                self._stats.dropped("error")
            except InvalidStateError:
                pass  # resolved meanwhile

    def _timed_out(self, request: Request) -> Any:
        fut, error = request.future, timeout_error(request)
        if fut.cancel():
            if self._queue is not None and self._queue.discard(request):
                self._stats.dropped("timeout")  # else a worker took it: it counts the cancel
            raise error
        try:  # running: settle it now, so the worker's output is dropped, not counted
            fut.set_exception(error)
        except InvalidStateError:
            return fut.result()  # it finished just in time
        self._stats.dropped("timeout")
        raise error

    async def output_async(self, x: object, *, timeout: float | None | _Unset = _UNSET,
                           return_version: bool = False, **inputs: object) -> Any:
        """``await`` the model's output for ``x`` without blocking the event loop (inputs as
        ``output()``'s)."""
        x = _call_input(x, inputs)
        seconds = self._timeout_for(timeout)
        if self._slots is not None:
            return await asyncio.to_thread(self.output, x, timeout=seconds,
                                           return_version=return_version)
        future: Future[Any] = Future()
        request = self._make_request(x, seconds, return_version, future)
        assert self._queue is not None
        try:
            self._queue.put(request, block=False)
            self._stats.accepted()
        except QueueFullError:  # wait for room on a thread, not on the event loop
            await asyncio.to_thread(self._enqueue, request, True)
        except InferenceClosedError:
            self._stats.rejected("closed")
            raise
        remaining = None if request.deadline is None else request.deadline - time.monotonic()
        wrapped = asyncio.wrap_future(future)
        try:  # asyncio.wait, not wait_for: a timeout must be counted as one, not as a cancel
            done, _ = await asyncio.wait({wrapped}, timeout=remaining)
        except asyncio.CancelledError:  # a client gone: its place in the queue goes back
            wrapped.cancel()  # an outcome that comes later is nobody's
            if future.cancel() and self._queue.discard(request):
                self._stats.dropped("cancelled")  # else a worker took it: it counts the cancel
            raise
        if done:
            return wrapped.result()
        wrapped.cancel()  # it gets no outcome: the pool's future settles as the timeout says
        return self._timed_out(request)

    # ------------------------------------------------------------------ model and lifecycle

    @property
    def model_version(self) -> int:
        """The version new requests run on: 1 at construction, +1 per update_model()."""
        return self._generation.version

    @property
    def inference_mode(self) -> InferenceMode:
        """The mode this pool runs in."""
        return self._config.mode

    @property
    def closed(self) -> bool:
        """True once close() was called, or once every worker thread has stopped."""
        return self._closed or (self._workers is not None and not self._workers.alive())

    @property
    def workers(self) -> int:
        """The number of replicas (worker slots)."""
        return len(self._devices)

    @property
    def queue_limit(self) -> int:
        """The most requests that wait: queued, or (in place) waiting for a free replica."""
        return self._config.queue_limit

    @property
    def batch_limit(self) -> int:
        """The most rows merged into one forward pass (batched mode)."""
        return self._config.batch_limit

    @property
    def max_wait_ms(self) -> float:
        """How long a batch waits for more requests, in milliseconds (batched mode)."""
        return self._config.max_wait * 1000

    @property
    def timeout(self) -> float | None:
        """Each request's default time limit, in seconds (None: none)."""
        return self._config.timeout

    @property
    def devices(self) -> list[torch.device]:
        """Each replica's device."""
        return list(self._devices)

    def update_model(self, model: nn.Module, *, example_input: object = None) -> int:
        """Swap in a new model without failing or losing a request; returns its version.

        New replicas are built and warmed (on ``example_input``, or else on an input the current
        model served) while the old ones keep serving; new batches then go to the new ones, and
        batches in flight finish on the old ones. On failure, raises ModelUpdateError and the
        old model keeps serving.
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
        if self._closed:
            raise InferenceClosedError("update_model() after close(); create a new pool")
        with self._swap_lock:
            old = self._generation
            example = (self._example(example_input) if example_input is not None
                       else example_of(old))
            try:
                new = build_generation(model, old.version + 1, self._devices, self._precision,
                                       merges=self._merges)
                if example is not None:
                    warm_up(new, example, merges=self._merges)
            except Exception as exc:
                raise ModelUpdateError(
                    f"could not build and warm model version {old.version + 1}: "
                    f"{type(exc).__name__}: {exc}. Version {old.version} keeps serving; if the "
                    "new model takes other inputs, pass example_input=") from exc
            self._generation = new  # one attribute write: each batch reads it once
            return new.version

    def stats(self) -> InferenceStats:
        """Counters, batch-size histogram, queue/forward time percentiles, rejections."""
        return {**self._stats.as_dict(), "mode": self._config.mode.value,
                "workers": len(self._devices), "devices": [str(d) for d in self._devices],
                "precision": self._precision.name, "model_version": self.model_version,
                "closed": self.closed,
                "queued": len(self._queue) if self._queue is not None else 0}

    def totals(self, version: int | None = None) -> VersionTotals:
        """Cumulative counts and nanoseconds of one model version (default: the one served
        now), as Triton's statistics report them (``paraloom.inference.totals``; 16 kept)."""
        return self._stats.totals.of(self.model_version if version is None else version)

    def close(self, *, drain: bool = True, timeout: float | None = None) -> None:
        """Stop taking requests; run what is queued (``drain=False``: fail it); stop workers.

        Waits up to ``timeout`` seconds for the workers; whatever is still queued then is failed
        with InferenceClosedError, so no caller waits forever. Safe to call twice.
        """
        with self._state_lock:
            first, self._closed = not self._closed, True
        if self._slots is not None:
            self._slots.close()
            return
        assert self._queue is not None and self._workers is not None
        if first:
            self._workers.stopping = True
            self._queue.close()
            if not drain:
                fail_requests(self._queue.clear(), InferenceClosedError,
                              "close(drain=False) was called before this request ran",
                              self._stats, "closed")
        busy = self._workers.join(timeout)
        fail_requests(self._queue.clear(), InferenceClosedError,
                      f"close(timeout={timeout}) ran out of time before this request ran",
                      self._stats, "closed")
        if self._deadlines is not None:
            self._deadlines.close(timeout)
        if busy:
            warnings.warn(f"close(): {', '.join(busy)} still running a batch after timeout="
                          f"{timeout}; they stop when it finishes", stacklevel=2)

    shutdown = close

    def __enter__(self) -> ParallelInference:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        """``close()``: what is queued runs first, unless a Ctrl-C ends the block (then it is
        failed with ``InferenceClosedError`` at once: 30 queued half-second requests held a
        Ctrl-C back for 14.5 s)."""
        interrupted = exc_type is not None and issubclass(exc_type, KeyboardInterrupt)
        self.close(drain=not interrupted)

    def __repr__(self) -> str:
        return (f"ParallelInference(mode={self._config.mode.value!r}, workers="
                f"{len(self._devices)}, model_version={self.model_version}, "
                f"closed={self._closed})")


class _Current:
    """The generation new batches run on, shared by the pool and its worker threads."""

    __slots__ = ("generation",)

    def __init__(self, generation: Generation) -> None:
        self.generation = generation


def _abandon(queue: RequestQueue, workers: WorkerThreads, deadlines: Deadlines) -> None:
    """A pool collected without ``close()``: stop taking requests; the workers run what is
    queued, then stop (not waited for: this may run in any thread)."""
    workers.stopping = True
    queue.close()
    deadlines.close(0)

