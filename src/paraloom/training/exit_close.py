"""Worker pools that a script leaves open are closed at interpreter exit as ``close()`` closes
them: each worker is asked to stop and exits on its own, so what it started (``torch.compile``'s
compile workers, loader processes) is cleaned up by the worker itself. Killed instead, it
leaves those to Python's resource tracker, which warns of leaked semaphores."""

from __future__ import annotations

import atexit
import contextlib
import weakref

from paraloom.training.pool import Pool

__all__ = ["close_at_exit"]

_OPEN: weakref.WeakSet[Pool] = weakref.WeakSet()


def close_at_exit(pool: Pool) -> Pool:
    """Remember ``pool`` (weakly) to close it at exit if it is still open then; returns it."""
    _OPEN.add(pool)
    return pool


@atexit.register  # registered after multiprocessing's own exit handler, so it runs before it
def _close_open_pools() -> None:
    for pool in list(_OPEN):
        with contextlib.suppress(Exception):
            pool.close()
