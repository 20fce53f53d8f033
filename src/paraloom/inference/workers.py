"""The worker threads of the queued modes: each takes batches and runs them on its replica."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from paraloom.inference.batching import RequestQueue
from paraloom.inference.errors import InferenceError
from paraloom.inference.execute import fail_requests, serve_batch_guarded
from paraloom.inference.replicas import Generation
from paraloom.inference.stats import StatsRecorder

__all__ = ["WorkerThreads", "TICK"]

# The longest any thread here sleeps before re-checking that the pool is alive.
TICK = 1.0


class WorkerThreads:
    """One daemon thread per replica slot, named ``paraloom-inference-<slot>``.

    ``current`` returns the generation (model version) a new batch runs on; it is read once
    per batch, so a swap never touches a batch in flight.
    """

    def __init__(self, queue: RequestQueue, devices: list[torch.device],
                 current: Callable[[], Generation], stats: StatsRecorder,
                 threads_per_worker: int | None) -> None:
        self._queue = queue
        self._devices = devices
        self._current = current
        self._stats = stats
        self._threads_per_worker = threads_per_worker
        self._threads: list[threading.Thread] = []
        self.stopping = False  # set by close(): a worker that exits then is expected to

    def start(self) -> None:
        """Start every worker and wait until each has set up its thread (torch threads, device)."""
        saved_threads = torch.get_num_threads()
        readies = []
        for slot in range(len(self._devices)):
            ready = threading.Event()
            thread = threading.Thread(target=self._work, args=(slot, ready), daemon=True,
                                      name=f"paraloom-inference-{slot}")
            thread.start()
            self._threads.append(thread)
            readies.append(ready)
        for ready, thread in zip(readies, self._threads, strict=True):
            while not ready.wait(TICK) and thread.is_alive():
                pass
        if self._threads_per_worker is not None:
            # torch.set_num_threads in a worker sizes that thread's own OpenMP pool, and also
            # sets the default that threads started later inherit: give the process its own back.
            torch.set_num_threads(saved_threads)

    def _work(self, slot: int, ready: threading.Event) -> None:
        try:
            try:
                if self._threads_per_worker is not None:
                    # The first torch call in a thread copies the process default into it;
                    # make that happen now, then set this thread's own size on top of it.
                    torch.get_num_threads()
                    torch.set_num_threads(self._threads_per_worker)
                if self._devices[slot].type == "cuda":
                    torch.cuda.set_device(self._devices[slot])
            finally:
                ready.set()
            with torch.inference_mode():
                while True:
                    batch = self._queue.take(TICK)
                    if batch:
                        serve_batch_guarded(self._current(), slot, batch, self._stats)
                    elif self._queue.closed and not len(self._queue):
                        return
        finally:
            self._exited()

    def _exited(self) -> None:
        """If the last worker stopped while the pool is open, fail what is queued (no hang)."""
        me = threading.current_thread()
        if self.stopping or any(t.is_alive() for t in self._threads if t is not me):
            return
        stopped = ("every inference worker thread has stopped (a model raised SystemExit or "
                   "KeyboardInterrupt, which end the thread they run on); this ParallelInference "
                   "cannot serve requests any more: close it and create a new one")
        self._queue.close(stopped)
        fail_requests(self._queue.clear(), InferenceError, stopped, self._stats, "error")

    def alive(self) -> bool:
        """True while at least one worker thread runs."""
        return any(t.is_alive() for t in self._threads)

    def join(self, timeout: float | None) -> list[str]:
        """Wait up to ``timeout`` for the workers to stop; the names of those still running."""
        deadline = None if timeout is None else time.monotonic() + timeout
        me = threading.current_thread()
        others = [t for t in self._threads if t is not me]  # close() from a done-callback
        for thread in others:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return [t.name for t in others if t.is_alive()]
