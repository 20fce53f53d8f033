"""Errors raised by ParallelInference; each names what went wrong and how to fix it.

HTTP mapping used by ``paraloom.serving`` (stable names):

===========================  =======  ============================================
exception                    status   when
===========================  =======  ============================================
``InvalidRequestError``      400      the request is malformed, or failed on its own
``QueueFullError``           503      the queue stayed full for the whole ``timeout``
``InferenceClosedError``     503      the pool is closed, or closed with ``drain=False``
``RequestTimeoutError``      504      the request's ``timeout`` passed before it ran
``ModelUpdateError``         (none)   ``update_model`` failed; the old model keeps serving
``InferenceError``           500      anything else (the model failed on every request)
===========================  =======  ============================================
"""

from __future__ import annotations

from paraloom.errors import ParaloomError

__all__ = [
    "InferenceClosedError",
    "InferenceError",
    "InvalidRequestError",
    "ModelUpdateError",
    "QueueFullError",
    "RequestTimeoutError",
]


class InferenceError(ParaloomError):
    """Base class of ParallelInference's errors; raised as is when the model itself failed."""


class InvalidRequestError(InferenceError, ValueError):
    """A request was malformed, or the model failed on it alone; ``received``/``expected`` say how.

    ``received`` describes the request's input (e.g. ``"Tensor(N, 3, 28, 28) float32"``);
    ``expected`` describes an input this model version accepted, or is ``None`` when none has
    been seen yet. The model's own exception, if any, is the ``__cause__``.
    """

    def __init__(self, message: str, *, received: str | None = None,
                 expected: str | None = None) -> None:
        super().__init__(message)
        self.received = received
        self.expected = expected


class QueueFullError(InferenceError):
    """The request queue held ``queue_limit`` requests for the whole wait; retry later."""


class RequestTimeoutError(InferenceError, TimeoutError):
    """The request's ``timeout`` passed before its result was ready."""


class InferenceClosedError(InferenceError):
    """The pool is closed (or closing without draining) and will not run this request."""


class ModelUpdateError(InferenceError):
    """``update_model`` could not build or warm the new replicas; the old model keeps serving."""
