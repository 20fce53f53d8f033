"""Training listeners: callbacks the parent process fires once per round, not once per worker."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["TrainingListener", "as_listener"]


class TrainingListener:
    """Override the hooks you need. ``iteration`` counts rounds across fit() calls."""

    def on_fit_start(self, wrapper: Any) -> None:
        """Before the first round of a fit()."""

    def on_epoch_start(self, epoch: int) -> None:
        """Before the first round of an epoch."""

    def on_iteration(self, iteration: int, epoch: int, loss: float) -> None:
        """After a round: ``loss`` is the mean loss of the workers that trained in it."""

    def on_epoch_end(self, epoch: int, loss: float) -> None:
        """After the last round of an epoch; ``loss`` is the epoch's mean round loss."""

    def on_fit_end(self, wrapper: Any) -> None:
        """After the final synchronization; the user's model holds the result."""


class _CallableListener(TrainingListener):
    def __init__(self, fn: Callable[[int, int, float], Any]) -> None:
        self.fn = fn

    def on_iteration(self, iteration: int, epoch: int, loss: float) -> None:
        self.fn(iteration, epoch, loss)


def as_listener(obj: Any) -> TrainingListener:
    """A TrainingListener, or a callable ``fn(iteration, epoch, loss)`` wrapped as one."""
    if isinstance(obj, TrainingListener):
        return obj
    if callable(obj):
        return _CallableListener(obj)
    raise TypeError(f"a listener must be a TrainingListener or a callable (iteration, epoch, "
                    f"loss); got {type(obj).__name__}")
