"""Errors the server answers with: each carries its HTTP status and a metrics reason."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "AlreadyExistsError",
    "ClientGoneError",
    "ForbiddenError",
    "ModelFailedError",
    "NotFoundError",
    "PayloadTooLargeError",
    "ProtocolError",
    "ServingError",
    "UnavailableError",
    "cut_off_by_shutdown",
    "listed",
    "short_repr",
]


def short_repr(value: object, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters for error messages."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


_LISTED = 20
"""Names an error lists at most: a gRPC error's text travels in a header, which clients cap at
8 KB, so a repository of hundreds of models must not name them all."""


def listed(names: Iterable[str]) -> str:
    """``names`` sorted, as a list's repr: the first 20 of them and how many more."""
    every = sorted(names)
    shown = repr(every[:_LISTED])
    return shown if len(every) <= _LISTED else f"{shown[:-1]}, ... {len(every) - _LISTED} more]"


class ServingError(Exception):
    """An error answered as ``{"error": message}`` with ``status``; ``reason`` labels metrics."""

    status = 500
    reason = "internal"

    def __init__(self, message: str, *, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after


class ProtocolError(ServingError, ValueError):
    """A request that breaks the protocol or the model's contract: HTTP 400."""

    status = 400
    reason = "bad_request"


class AlreadyExistsError(ProtocolError):
    """A name already taken (a shared memory region registered twice): HTTP 400, as Triton
    answers it, and gRPC ``ALREADY_EXISTS``."""

    reason = "already_exists"


class NotFoundError(ProtocolError):
    """An unknown model, version, output or route: HTTP 404."""

    status = 404
    reason = "not_found"


class ForbiddenError(ServingError):
    """A model load the server is not configured to allow: HTTP 403."""

    status = 403
    reason = "forbidden"


class PayloadTooLargeError(ProtocolError):
    """A body over the configured limit: HTTP 413."""

    status = 413
    reason = "body_too_large"


class ClientGoneError(ProtocolError):
    """The client disconnected before its request was read: nothing is answered (logged as
    nginx's 499, "client closed request")."""

    status = 499
    reason = "client_disconnected"


class UnavailableError(ServingError):
    """The queue is full or the server is shutting down: HTTP 503, try again later."""

    status = 503
    reason = "unavailable"

    def __init__(self, message: str, *, reason: str = "unavailable", retry_after: int = 1
                 ) -> None:
        super().__init__(message, retry_after=retry_after)
        self.reason = reason


def cut_off_by_shutdown() -> UnavailableError:
    """The error for a request still running when the server's graceful timeout ran out (the
    server cancels it): 503 / ``UNAVAILABLE``, where uvicorn would answer a bare 500."""
    return UnavailableError("the server shut down before this request was answered (its "
                            "graceful timeout ran out); send it again", reason="shutting_down")


class ModelFailedError(ServingError):
    """The model itself failed (on every try), not the request: HTTP 500."""

    status = 500
    reason = "model_error"
