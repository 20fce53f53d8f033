"""Which thread runs a wrapper's fit(): one fit at a time, and a close() from another thread
that waits for the running fit to stop instead of pulling its workers away."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, cast

_Fit = TypeVar("_Fit", bound=Callable[..., Any])


class FitGuard:
    """The thread of the running fit(), if any; set and cleared under a lock, so two threads
    calling fit() at once cannot both start."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: int | None = None
        self._idle = threading.Event()
        self._idle.set()
        self.closing = False
        """close() was called from another thread: the running fit stops as it starts."""

    @property
    def running(self) -> bool:
        """Whether a fit() runs now, in any thread."""
        return self._thread is not None

    def in_fit(self) -> bool:
        """Whether the calling thread is the one running fit() (a listener, a step hook)."""
        return self._thread == threading.get_ident()

    def enter(self) -> None:
        """Mark a fit() as running in this thread; ``RuntimeError`` when one runs already."""
        with self._lock:
            if self._thread is not None:
                raise RuntimeError(
                    "fit() was called while fit() is running (from a listener, or another "
                    "thread): a listener may call wrapper.stop() to end training after the "
                    "round in flight; call fit() again once the running one has returned")
            self._thread = threading.get_ident()
            self.closing = False
            self._idle.clear()

    def leave(self) -> None:
        with self._lock:
            self._thread = None
            self._idle.set()

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the running fit() to return; whether it did."""
        return self._idle.wait(timeout_s)


class _Guarded(Protocol):
    _fit_guard: FitGuard


def one_fit_at_a_time(fit: _Fit) -> _Fit:
    """Refuse fit() while one is running (from a listener, or another thread)."""

    @functools.wraps(fit)
    def guarded(self: _Guarded, *args: Any, **kwargs: Any) -> Any:
        self._fit_guard.enter()
        try:
            return fit(self, *args, **kwargs)
        finally:
            self._fit_guard.leave()

    return cast(_Fit, guarded)
