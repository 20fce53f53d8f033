"""Ctrl-C during ``fit()``: the first one stops the fit after the round in flight and keeps
what was trained; a second one aborts at once.

The workers ignore SIGINT (a terminal sends it to the whole process group): the parent decides
when they stop. It takes over SIGINT only on the main thread, and only while Python's own
handler is installed, so a handler of the user's (or of a framework around it) is left alone.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType

__all__ = ["deferred_interrupt", "graceful_interrupt"]


@contextlib.contextmanager
def graceful_interrupt(stop: Callable[[], None]) -> Iterator[Callable[[], bool]]:
    """While inside, the first SIGINT calls ``stop()`` (which must only set a flag) instead
    of raising, and puts the previous handler back, so a second SIGINT raises
    ``KeyboardInterrupt`` where the program is. Yields a function that tells whether the
    first one came."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() \
            or previous is not signal.default_int_handler:
        yield lambda: False
        return
    interrupted = False

    def on_interrupt(signum: int, frame: FrameType | None) -> None:
        nonlocal interrupted
        interrupted = True
        signal.signal(signal.SIGINT, previous)
        stop()
        # A handler may run inside a buffered write of the main thread: never fail over it.
        with contextlib.suppress(RuntimeError, OSError, ValueError):
            print("\nparaloom: interrupted: stopping after the round in flight, keeping what "
                  "was trained (Ctrl-C again to abort at once)", file=sys.stderr, flush=True)

    signal.signal(signal.SIGINT, on_interrupt)
    try:
        yield lambda: interrupted
    finally:
        if signal.getsignal(signal.SIGINT) is on_interrupt:
            signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def deferred_interrupt() -> Iterator[None]:
    """While inside, a SIGINT waits: when the block has run to its end (copying the trained
    weights into the user's model, which a Ctrl-C in the middle left half updated: 7 of 600
    parameters), the handler that was installed gets it (Python's raises
    ``KeyboardInterrupt``; one of the user's, or PySpark's, runs as it would have). Only on
    the main thread, where signal handlers run."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    pending: list[FrameType | None] = []

    def on_interrupt(signum: int, frame: FrameType | None) -> None:
        pending.append(frame)

    signal.signal(signal.SIGINT, on_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if pending:
        if callable(previous):
            previous(signal.SIGINT, pending[0])
        elif previous == signal.SIG_DFL:
            signal.raise_signal(signal.SIGINT)
