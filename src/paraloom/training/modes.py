"""Training modes and how a mode name becomes a synchronizer."""

from __future__ import annotations

from enum import Enum
from typing import Any

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
    from paraloom.sync.registry import build_synchronizer

    return build_synchronizer(mode, **options)
