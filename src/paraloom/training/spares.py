"""Spare pools: whole sets of workers started ahead, so a recovery need not start its own.

A ``RecoveringPool`` whose pool cannot regroup (NCCL: a collective with a dead peer hangs
instead of failing) replaces every worker at a failure (see ``training.recovery``); a pool
that can keeps spare workers of its own (``training.launch.SpareWorkers``). Starting
them costs about a tenth of a second from the forkserver (new processes, a rendezvous, a
process group); a spare has paid that already and waits, idle, in a group of its own. The
recovery takes one, and a replacement starts on a background thread.

Defined behaviour at the edges:

- a failure while the only spare is still starting waits for it (it is further along than a
  new start), at most ``timeout_s``;
- a spare whose workers died while they waited is killed and not used;
- a spare that could not start is logged and left out: the recovery starts its own workers;
- ``close()`` stops the spares, and a start still in flight is killed as soon as it is done;
- the replacement for a spare taken starts ``restock_delay_s`` later, so that it does not take
  CPU from the replay that follows a recovery (on 2 cores it slowed the replay's rounds by
  half); a failure before then starts its own workers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from paraloom.training.pool import Pool

__all__ = ["Spares"]

log = logging.getLogger("paraloom")

_JOIN_S = 0.05


class Spares:
    """Up to ``count`` pools made by ``start`` on background threads, ready to take over."""

    def __init__(self, start: Callable[[], Pool], count: int,
                 restock_delay_s: float = 1.0) -> None:
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"spares={count!r}; expected an int >= 0")
        self._start = start
        self.count = count
        self.restock_delay_s = restock_delay_s
        self._ready: list[Pool] = []
        self._starting: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._delayed: set[threading.Thread] = set()
        """Starts still waiting out ``restock_delay_s``: a failure does not wait for them."""
        self._stopping = threading.Event()
        """Set by ``close()`` and ``kill()`` (under the lock): no spare is kept after."""
        for _ in range(count):
            self._launch()

    @property
    def pids(self) -> list[int]:
        """The process ids of the spares that are ready."""
        with self._lock:
            return [pid for pool in self._ready for pid in pool.pids]

    @property
    def ready(self) -> int:
        with self._lock:
            return len(self._ready)

    def take(self, timeout_s: float) -> Pool | None:
        """A spare whose workers are alive, waiting up to ``timeout_s`` for one that is
        starting; None when there is none. Starts a replacement either way."""
        deadline = time.monotonic() + timeout_s
        pool = None
        while pool is None:
            with self._lock:
                if self._ready:
                    pool = self._ready.pop(0)
                    break
                starting = [t for t in self._starting
                            if t.is_alive() and t not in self._delayed]
            if not starting or time.monotonic() >= deadline:
                break
            starting[0].join(min(_JOIN_S, max(0.0, deadline - time.monotonic())))
        if pool is not None and not pool.alive:
            log.warning("paraloom: a spare's workers died while it waited; starting new ones")
            pool.kill()
            pool = None
        if not self._stopping.is_set():
            self._launch(self.restock_delay_s)
        return pool

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop every spare; wait up to ``timeout_s`` for starts in flight (each kills its
        pool when done)."""
        with self._lock:
            self._stopping.set()
            ready, self._ready = self._ready, []
            starting = list(self._starting)
        for pool in ready:
            pool.close(timeout_s)
        deadline = time.monotonic() + timeout_s
        for thread in starting:
            thread.join(max(0.0, deadline - time.monotonic()))

    def kill(self) -> None:
        """Stop every spare now; a start in flight kills its pool when done."""
        with self._lock:
            self._stopping.set()
            ready, self._ready = self._ready, []
        for pool in ready:
            pool.kill()

    def _launch(self, delay_s: float = 0.0) -> None:
        with self._lock:
            self._starting = [t for t in self._starting if t.is_alive()]
            if len(self._ready) + len(self._starting) >= self.count:
                return
            thread = threading.Thread(target=self._run, args=(delay_s,), name="paraloom-spare",
                                      daemon=True)
            self._starting.append(thread)
            if delay_s > 0:
                self._delayed.add(thread)
        thread.start()

    def _run(self, delay_s: float) -> None:
        if delay_s > 0:
            self._stopping.wait(delay_s)
        with self._lock:
            self._delayed.discard(threading.current_thread())
            if self._stopping.is_set():
                return
        try:
            pool = self._start()
        except Exception as e:  # logged: a recovery then starts its own workers
            log.warning("paraloom: a spare set of workers could not start (%s); a recovery "
                        "will start its own", str(e).splitlines()[0] if str(e) else repr(e))
            return
        with self._lock:
            if not self._stopping.is_set():
                self._ready.append(pool)
                return
        pool.kill()
