"""Exceptions raised by paraloom."""

from __future__ import annotations

__all__ = ["ParaloomError", "WorkerError", "NotPicklableError", "FitInterrupted"]


class ParaloomError(RuntimeError):
    """Base class of paraloom's own errors (a ``RuntimeError``): ``except ParaloomError``
    catches a worker's failure (``WorkerError``) and the others paraloom raises itself."""


class WorkerError(ParaloomError):
    """A training worker raised or died.

    ``worker`` (rank), ``batch`` (the round it failed in; for a death or a hang, the last
    round it started; None before its first), ``remote_type`` (the exception's class name in the
    worker, e.g. ``"NonFiniteLossError"``; None when the process died) and ``remote_traceback``
    say where and why; ``silent_seconds``, for a worker found frozen or hung, how long nothing
    had been heard from it.
    """

    def __init__(self, message: str, *, worker: int | None = None, batch: int | None = None,
                 remote_traceback: str | None = None, remote_type: str | None = None,
                 silent_seconds: float | None = None) -> None:
        self.worker = worker
        self.batch = batch
        self.remote_traceback = remote_traceback
        self.remote_type = remote_type
        self.silent_seconds = silent_seconds
        text = message
        if remote_traceback:
            text += "\n\nTraceback in the worker:\n" + remote_traceback.rstrip()
        super().__init__(text)


class NotPicklableError(ParaloomError, TypeError):
    """Something that must be sent to worker processes cannot be pickled."""


class FitInterrupted(KeyboardInterrupt):
    """``fit()`` was stopped by Ctrl-C after the round in flight; the model (and your
    optimizer) hold what was trained until then. A ``KeyboardInterrupt``, so a program stops
    as it would have; catch it to keep going (save the model, evaluate it). ``iterations``: the
    wrapper's iteration count when it stopped."""

    def __init__(self, iterations: int) -> None:
        self.iterations = iterations
        super().__init__(f"fit() was interrupted after {iterations} iterations; the model "
                         "holds the parameters trained so far")
