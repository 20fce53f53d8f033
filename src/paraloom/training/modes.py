"""Training modes and how a mode name becomes a synchronizer."""

from __future__ import annotations

from enum import Enum
from typing import Any

from paraloom.sync.averaging import Averaging
from paraloom.sync.base import Synchronizer

__all__ = ["TrainingMode", "make_synchronizer"]


class TrainingMode(str, Enum):
    """How the replicas stay consistent."""

    AVERAGING = "averaging"
    """Average parameters (and optimizer state) every ``averaging_frequency`` rounds."""
    SHARED_GRADIENTS = "shared_gradients"
    """Exchange threshold-encoded updates every step (Strom 2015, DL4J's recommended mode)."""
    ALLREDUCE = "allreduce"
    """Average dense gradients every step through PyTorch DDP."""
    CUSTOM = "custom"
    """A user-supplied ``Synchronizer``."""


def make_synchronizer(mode: Any, **options: Any) -> Synchronizer:
    """The synchronizer for ``mode``: a TrainingMode, its name, or a Synchronizer instance."""
    if isinstance(mode, Synchronizer):
        return mode
    if isinstance(mode, type) and issubclass(mode, Synchronizer):
        raise TypeError(f"training_mode={mode.__name__} is a class; pass an instance, "
                        f"e.g. training_mode={mode.__name__}()")
    try:
        mode = TrainingMode(mode.lower() if isinstance(mode, str) else mode)
    except ValueError:
        names = ", ".join(repr(m.value) for m in TrainingMode if m is not TrainingMode.CUSTOM)
        raise ValueError(f"training_mode={mode!r} is not a mode; expected one of {names} or a "
                         "Synchronizer instance") from None
    if mode is TrainingMode.AVERAGING:
        return Averaging(frequency=options.get("averaging_frequency", 1),
                         average_updaters=options.get("average_updaters", True))
    if mode is TrainingMode.CUSTOM:
        raise ValueError("training_mode='custom' needs the synchronizer itself: pass "
                         "training_mode=MySynchronizer(...) (a paraloom.Synchronizer subclass)")
    from paraloom.sync import registry  # the update-sharing and all-reduce synchronizers

    return registry.build_synchronizer(mode.value, **options)
