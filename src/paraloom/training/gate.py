"""RoundGate: which rounds the workers may still train once ``stop()`` was called.

The rounds are queued ahead of the workers; ``stop()`` must end a fit after the round in
flight, not after every queued one. A round is trained by every worker or by none (each holds
collectives the others wait in), so the parent and the workers decide under one lock: a worker
records each round it starts, and the parent, halting, allows no round past the last one any
worker has started. Later rounds are skipped by every worker alike.

Each worker also records the last round whose batch it holds (``fetched``) and whose loss it
computed (``computed``): when the workers hang, the one that started a round and never got
its batch hangs in its data, one that never got to its loss in its own code (the model), and
the others only wait for it in a collective (``stuck`` lists them in that order: a worker in
a collective inside ``forward``, as DDP's broadcast of buffers, has its batch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # ForkServerContext does not exist on Windows
    from multiprocessing.context import ForkServerContext, SpawnContext

__all__ = ["RoundGate"]

_OPEN = 2**62


class RoundGate:
    """A shared array: the last round each worker started, the last round to train, then the
    last round whose loss each worker computed, then the last round whose batch it holds."""

    def __init__(self, array: Any) -> None:
        self.array = array  # a multiprocessing.Array("q", 3 * workers + 1) with its lock
        self.workers = (len(array) - 1) // 3

    @classmethod
    def create(cls, ctx: ForkServerContext | SpawnContext, workers: int) -> RoundGate:
        gate = cls(ctx.Array("q", 3 * workers + 1))
        gate.reset()
        return gate

    def reset(self) -> None:
        """A new fit(): no round started, every round open."""
        with self.array.get_lock():
            for rank in range(self.workers):
                self.array[rank] = self.array[self.workers + 1 + rank] = -1
                self.array[2 * self.workers + 1 + rank] = -1
            self.array[self.workers] = _OPEN

    def fetched(self, rank: int) -> None:
        """Worker ``rank`` holds the batch of the round it started last."""
        with self.array.get_lock():
            self.array[2 * self.workers + 1 + rank] = self.array[rank]

    def computed(self, rank: int) -> None:
        """Worker ``rank`` has the loss of the round it started last (or is idle in it): its
        own work for the round is done, what follows are collectives with its peers."""
        with self.array.get_lock():
            self.array[self.workers + 1 + rank] = self.array[rank]

    def stuck(self, ranks: list[int]) -> list[int]:
        """Of ``ranks``, those that started a round and have not computed its loss: first
        those without its batch (``without_batch`` lists them), then the others."""
        stuck = self.without_batch(ranks)
        with self.array.get_lock():
            return stuck + [r for r in ranks if r not in stuck
                            and self.array[self.workers + 1 + r] < self.array[r]]

    def without_batch(self, ranks: list[int]) -> list[int]:
        """Of ``ranks``, those that started a round and do not hold its batch yet."""
        with self.array.get_lock():
            return [r for r in ranks if self.array[2 * self.workers + 1 + r] < self.array[r]
                    and self.array[self.workers + 1 + r] < self.array[r]]

    def started(self, rank: int) -> int | None:
        """The last round worker ``rank`` started in this fit, or None before its first. Read
        without the lock: a worker killed while it held the lock holds it for ever."""
        last = int(self.array.get_obj()[rank])
        return None if last < 0 else last

    def admit(self, rank: int, round_id: int) -> bool:
        """Whether worker ``rank`` trains ``round_id`` (recorded as started) or skips it."""
        with self.array.get_lock():
            if round_id > self.array[self.workers]:
                return False
            self.array[rank] = max(self.array[rank], round_id)
            return True

    def halt(self, last: int | None = None, timeout_s: float | None = None) -> int:
        """Allow no round after the last one a worker started (or ``last``); returns it.
        ``timeout_s``: wait at most this long for the lock (a worker killed while it held
        it holds it for ever), then raise TimeoutError."""
        lock = self.array.get_lock()
        if not lock.acquire(timeout=timeout_s):
            raise TimeoutError(f"the round gate's lock was not free within {timeout_s:g} s")
        try:
            if last is None:
                last = max(self.array[rank] for rank in range(self.workers))
            self.array[self.workers] = min(self.array[self.workers], last)
            return int(self.array[self.workers])
        finally:
            lock.release()
