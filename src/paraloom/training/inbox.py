"""Inbox: a pool's replies, read off its result queue by a thread of their own."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing import connection
from multiprocessing.connection import Connection
from multiprocessing.queues import Queue
from typing import Any

from paraloom.training.messages import Reply

__all__ = ["EXITED", "Exited", "Inbox"]


@dataclass(frozen=True)
class Exited:
    """What ``Inbox.get`` returns when a watched process has ended, after everything it sent."""


EXITED = Exited()

_POLL_S = 0.05
"""How long a read of a queue waits (a plain queue, in tests: how often it is polled)."""


class Inbox:
    """The replies, read off the workers' result queues by a thread of their own.

    Unpickling a reply fetches its tensors from the worker that sent it, and waits while that
    worker is stopped; with the read on this thread, the parent keeps watching the workers and
    kills a stopped one, which ends the wait.

    Each worker has a result queue of its own: a worker killed while it writes leaves its
    queue's lock held, which would stop every other writer of a shared one.

    ``watch(sentinels)``: the thread waits on the workers' process sentinels too, and puts
    ``EXITED`` in line when one ends, behind every reply that process sent (what a process
    wrote to its pipe is there before it ends, and the thread reads the pipes empty first): a
    worker killed, or exited without a word, is seen at once, and whatever it reported has
    been read by then.

    The thread sleeps until a pipe or a sentinel is ready, or ``watch`` or ``close`` wakes it:
    no timed wake-ups while the workers train (each costs about 0.1 ms of CPU on a VM).
    """

    def __init__(self, *results: Queue[Reply]) -> None:
        self._results = list(results)
        self._pipes = _pipes(self._results)
        self._live: list[int] = []
        """The sentinels of the watched processes that have not ended yet."""
        self._watching = threading.Lock()
        """``watch`` replaces the lists (never changes one) while the thread reads them."""
        self._items: queue.Queue[Reply | Exited | Exception] = queue.Queue()
        self._closed = threading.Event()
        # Closed when garbage-collected, never while either side may still use it.
        self._wake_up: tuple[Connection, Connection] = connection.Pipe(duplex=False)
        self._thread = threading.Thread(target=self._read, name="paraloom-replies", daemon=True)
        self._thread.start()

    def watch(self, sentinels: Sequence[int], results: Sequence[Queue[Reply]] | None = None
              ) -> None:
        """Put ``EXITED`` in line once for each of these process sentinels, when it ends (the
        list replaces the last one); ``results``: read these queues from now on instead."""
        with self._watching:
            self._live = list(sentinels)
            if results is not None:
                self._results = list(results)
                self._pipes = _pipes(self._results)
        self._wake()

    def _wake(self) -> None:
        """Make the thread look at its lists (and ``_closed``) again."""
        self._wake_up[1].send_bytes(b"")

    def _woken(self, ready: list[Any]) -> bool:
        """Whether ``ready`` holds the wake-up pipe; it is read empty."""
        wake = self._wake_up[0]
        if wake not in ready:
            return False
        while wake.poll():
            wake.recv_bytes()
        return True

    def _read(self) -> None:
        # Multiprocessing queues' pipes, waited on with the processes' sentinels, as the
        # standard library's ProcessPoolExecutor does; plain queues (in tests) are polled.
        while not self._closed.is_set():
            with self._watching:
                live, results, pipes = self._live, self._results, self._pipes
            if pipes is None:
                if any([self._take(q) for q in results]):
                    continue
                ready = connection.wait(live, timeout=0) if live else []
            else:
                try:
                    ready = connection.wait([self._wake_up[0], *pipes.keys(), *live])
                except (OSError, ValueError):  # a queue closed: the pool is done with it
                    if self._closed.is_set():
                        return
                    time.sleep(0.01)
                    continue
                if self._woken(ready):
                    continue  # the lists changed, or close
                taken = [self._take(pipes[r]) for r in ready if r in pipes]
                if taken:
                    continue  # the pipes read empty before an end is told
            if ready:
                with self._watching:
                    self._live = [s for s in self._live if s not in ready]
                self._items.put(EXITED)

    def _take(self, results: Queue[Reply]) -> bool:
        """Move one reply (or what reading it raised) into line; False when there was none."""
        try:
            item: Reply | Exception = results.get(timeout=_POLL_S)
        except queue.Empty:
            return False
        except Exception as e:  # a closed queue, or tensors of a worker that died
            if self._closed.is_set():
                return False
            item = e
            time.sleep(0.01)
        with self._watching:  # a queue ``watch`` let go of since: its replies are dropped
            if any(q is results for q in self._results):
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
        """Stop the reading thread; ``wait``: and wait for it (woken, it ends within ``_POLL_S``): a
        reply it still held, freed by it while the interpreter shuts down, aborts the process
        (status 134) after a fit that worked."""
        self._closed.set()
        self._wake()
        if wait:
            self._thread.join(timeout=10 * _POLL_S)


def _pipes(results: list[Queue[Reply]]) -> dict[Any, Queue[Reply]] | None:
    """Each multiprocessing queue by the pipe it is read from; None where a queue has none (a
    plain queue, in tests: polled)."""
    pipes = {getattr(q, "_reader", None): q for q in results}
    return None if None in pipes else pipes
