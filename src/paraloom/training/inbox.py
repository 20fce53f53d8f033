"""Inbox: a pool's replies, read off its result queue by a thread of their own."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing import connection
from multiprocessing.queues import Queue

from paraloom.training.messages import Reply

__all__ = ["EXITED", "Exited", "Inbox"]


@dataclass(frozen=True)
class Exited:
    """What ``Inbox.get`` returns when a watched process has ended, after everything it sent."""


EXITED = Exited()

_POLL_S = 0.05
"""How long the thread waits for a reply before it looks whether it should stop."""


class Inbox:
    """The replies, read off the result queue by a thread of their own.

    Unpickling a reply fetches its tensors from the worker that sent it, and waits while that
    worker is stopped; with the read on this thread, the parent keeps watching the workers and
    kills a stopped one, which ends the wait.

    ``watch(sentinels)``: the thread waits on the workers' process sentinels too, and puts
    ``EXITED`` in line when one ends, behind every reply that process sent (what a process
    wrote to the pipe is there before it ends, and the thread reads the pipe empty first): a
    worker killed, or exited without a word, is seen at once, and whatever it reported has
    been read by then.
    """

    def __init__(self, results: Queue[Reply]) -> None:
        self._results = results
        self._live: list[int] = []
        """The sentinels of the watched processes that have not ended yet."""
        self._items: queue.Queue[Reply | Exited | Exception] = queue.Queue()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._read, name="paraloom-replies", daemon=True)
        self._thread.start()

    def watch(self, sentinels: Sequence[int]) -> None:
        """Put ``EXITED`` in line once for each of these process sentinels, when it ends."""
        self._live = list(sentinels)

    def _read(self) -> None:
        # A multiprocessing queue's pipe, waited on with the processes' sentinels, as the
        # standard library's ProcessPoolExecutor does; a plain queue (in tests) is polled.
        pipe = getattr(self._results, "_reader", None)
        while not self._closed.is_set():
            live = self._live
            if pipe is None:
                if self._take():
                    continue
                ready = connection.wait(live, timeout=0) if live else []
            else:
                try:
                    ready = connection.wait([pipe, *live], timeout=_POLL_S)
                except (OSError, ValueError):  # the pool closed the queue: it is done with us
                    if self._closed.is_set():
                        return
                    raise
                if pipe in ready:
                    self._take()
                    continue  # the pipe read empty before an end is told
            if ready:
                self._live = [s for s in live if s not in ready]
                self._items.put(EXITED)

    def _take(self) -> bool:
        """Move one reply (or what reading it raised) into line; False when there was none."""
        try:
            item: Reply | Exception = self._results.get(timeout=_POLL_S)
        except queue.Empty:
            return False
        except Exception as e:  # a closed queue, or tensors of a worker that died
            if self._closed.is_set():
                return False
            item = e
            time.sleep(0.01)
        self._items.put(item)
        return True

    def get(self, timeout_s: float) -> Reply | Exited:
        """The next reply, or ``EXITED``; raises queue.Empty after ``timeout_s``, or what
        reading a reply raised."""
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
