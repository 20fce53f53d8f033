"""A one-shot result for one blocking caller: the part of a Future that ``output()`` needs.

``output()`` waits on one of these instead of a ``concurrent.futures.Future``: one lock handed
from the worker to the caller, no condition variable and no waiter list. With dozens of client
threads this saves a noticeable share of the per-request CPU (the GIL hand-offs are what cost).
Workers see the same methods as on a Future, so they treat both alike.
"""

from __future__ import annotations

import _thread
from concurrent.futures import CancelledError, InvalidStateError
from typing import Any

__all__ = ["Pending"]

_PENDING, _RUNNING, _CANCELLED, _DONE = range(4)


class Pending:
    """Future-like: set_running_or_notify_cancel / set_result / set_exception / cancel / result."""

    __slots__ = ("_ready", "_state_lock", "_state", "_value", "_error")

    def __init__(self) -> None:
        self._ready = _thread.allocate_lock()
        self._ready.acquire()  # released exactly once, when the outcome is known
        self._state_lock = _thread.allocate_lock()
        self._state = _PENDING
        self._value: Any = None
        self._error: BaseException | None = None

    def set_running_or_notify_cancel(self) -> bool:
        """Mark it running (True), unless it was cancelled (False)."""
        with self._state_lock:
            if self._state == _CANCELLED:
                return False
            self._state = _RUNNING
            return True

    def cancel(self) -> bool:
        """Cancel it unless it is running or done; True if it is cancelled now."""
        with self._state_lock:
            if self._state == _PENDING:
                self._state = _CANCELLED
                self._ready.release()
            return self._state == _CANCELLED

    def _finish(self, value: object, error: BaseException | None) -> None:
        with self._state_lock:
            if self._state in (_DONE, _CANCELLED):
                raise InvalidStateError("the outcome of this request was already set")
            self._value, self._error, self._state = value, error, _DONE
            self._ready.release()

    def set_result(self, value: object) -> None:
        """Give the caller its output."""
        self._finish(value, None)

    def set_exception(self, error: BaseException) -> None:
        """Give the caller an error."""
        self._finish(None, error)

    def done(self) -> bool:
        """True once it has an outcome or was cancelled."""
        return self._state in (_DONE, _CANCELLED)

    def cancelled(self) -> bool:
        """True if it was cancelled."""
        return self._state == _CANCELLED

    def result(self, timeout: float | None = None) -> Any:
        """Wait up to ``timeout`` for the outcome; TimeoutError if it is not there yet."""
        if self._state not in (_DONE, _CANCELLED):
            if not self._ready.acquire(True, -1 if timeout is None else timeout):
                raise TimeoutError("no outcome yet")
            self._ready.release()  # stay signalled for any later call
        if self._state == _CANCELLED:
            raise CancelledError()
        if self._error is not None:
            raise self._error
        return self._value
