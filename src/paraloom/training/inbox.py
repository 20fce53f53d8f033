"""Inbox: a pool's replies, read off its result queue by a thread of their own."""

from __future__ import annotations

import queue
import threading
import time
from multiprocessing.queues import Queue

from paraloom.training.messages import Reply

__all__ = ["Inbox"]

_POLL_S = 0.05
"""How long the thread waits for a reply before it looks whether it should stop."""


class Inbox:
    """The replies, read off the result queue by a thread of their own.

    Unpickling a reply fetches its tensors from the worker that sent it, and waits while that
    worker is stopped; with the read on this thread, the parent keeps watching the workers and
    kills a stopped one, which ends the wait.
    """

    def __init__(self, results: Queue[Reply]) -> None:
        self._results = results
        self._items: queue.Queue[Reply | Exception] = queue.Queue()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._read, name="paraloom-replies", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._closed.is_set():
            try:
                item: Reply | Exception = self._results.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            except Exception as e:  # a closed queue, or tensors of a worker that died
                if self._closed.is_set():
                    return
                item = e
                time.sleep(0.01)
            self._items.put(item)

    def get(self, timeout_s: float) -> Reply:
        """The next reply; raises queue.Empty after ``timeout_s``, or what reading it raised."""
        item = self._items.get(timeout=timeout_s) if timeout_s > 0 else self._items.get_nowait()
        if isinstance(item, Exception):
            raise item
        return item

    def close(self, wait: bool = True) -> None:
        """Stop the reading thread; ``wait``: and wait for it (it ends within ``_POLL_S``): a
        reply it still held, freed by it while the interpreter shuts down, aborts the process
        (status 134) after a fit that worked."""
        self._closed.set()
        if wait:
            self._thread.join(timeout=10 * _POLL_S)
