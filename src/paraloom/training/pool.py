"""The ``Pool`` protocol: what ParallelWrapper needs of the replicas it trains on."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from paraloom.training.messages import Answer, Begin, ToReplica

__all__ = ["Pool", "RegroupingPool"]


class Pool(Protocol):
    """Replicas that take messages by rank and answer on one reply stream."""

    workers: int
    backend: str
    devices: list[str]
    threads: int

    @property
    def pids(self) -> list[int]:
        """Process ids of the workers (empty when the replica runs in this process)."""
        ...

    @property
    def alive(self) -> bool:
        """Whether every worker can still take messages."""
        ...

    @property
    def warm(self) -> bool:
        """Whether the replicas keep what they ended the last fit() with, so the next ``Begin``
        may leave the model out (a restart, if any, restores it)."""
        ...

    def begin(self, messages: Sequence[Begin]) -> None:
        """Start a fit(): ``messages[rank]`` to each worker; sends nothing if one cannot be
        sent (``NotPicklableError``)."""
        ...

    def halt(self, last: int | None = None) -> int:
        """``stop()``: the workers skip every queued round after the one in flight (or after
        round ``last``); returns the last round that is trained."""
        ...

    def send(self, rank: int, message: ToReplica) -> None:
        """Queue a message for one worker; waits (watching the workers) while it is busy."""
        ...

    def recv(self, timeout_s: float | None = None) -> Answer | None:
        """The next answer, or None after ``timeout_s`` (0: only what is already there);
        raises ``WorkerError`` when a worker failed (its ``Failed`` reply)."""
        ...

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the workers, killing those that do not stop within ``timeout_s``."""
        ...

    def kill(self, wait: bool = True) -> None:
        """Stop every worker now; safe to call twice. ``wait``: and reap what they leave
        (False: a recovery follows at once; a later ``kill()`` or ``close()`` reaps)."""
        ...


@runtime_checkable
class RegroupingPool(Pool, Protocol):
    """A pool that can replace a failed worker and keep the others' processes."""

    survive: bool
    """Whether it can (``regroup`` raises ``WorkerError`` otherwise)."""

    @property
    def spare_pids(self) -> list[int]:
        """Process ids of the spare workers it keeps."""
        ...

    def regroup(self, failed: int) -> None:
        """Replace worker ``failed`` (and any other that has died) with a spare and form the
        process group again; every replica is then new, to be begun from a restore point.
        Raises ``WorkerError`` when it cannot: the caller starts new workers instead."""
        ...
