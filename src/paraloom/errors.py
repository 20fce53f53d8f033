"""Exceptions raised by paraloom."""

from __future__ import annotations

__all__ = ["ParaloomError", "WorkerError", "NotPicklableError"]


class ParaloomError(RuntimeError):
    """Base class of paraloom's own errors."""


class WorkerError(ParaloomError):
    """A training worker raised or died; ``worker``, ``batch`` and ``remote_traceback`` say where."""

    def __init__(self, message: str, *, worker: int | None = None, batch: int | None = None,
                 remote_traceback: str | None = None) -> None:
        self.worker = worker
        self.batch = batch
        self.remote_traceback = remote_traceback
        text = message
        if remote_traceback:
            text += "\n\nTraceback in the worker:\n" + remote_traceback.rstrip()
        super().__init__(text)


class NotPicklableError(ParaloomError, TypeError):
    """Something that must be sent to worker processes cannot be pickled."""
