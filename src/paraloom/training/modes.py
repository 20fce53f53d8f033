"""Training modes; ``paraloom.sync.registry`` turns one into a synchronizer."""

from __future__ import annotations

from enum import Enum

__all__ = ["TrainingMode"]


class TrainingMode(str, Enum):
    """How the replicas stay consistent: ``ParallelWrapper(training_mode=...)`` takes a member
    or its value ("averaging", "shared_gradients", "allreduce", "diloco"; "custom" is set by
    passing a ``Synchronizer``). An unknown name raises ``ValueError``."""

    AVERAGING = "averaging"
    """Average parameters (and optimizer state) every ``averaging_frequency`` rounds."""
    SHARED_GRADIENTS = "shared_gradients"
    """Exchange threshold-encoded updates every step (Strom 2015, DL4J's recommended mode)."""
    ALLREDUCE = "allreduce"
    """Average dense gradients every step through PyTorch DDP."""
    DILOCO = "diloco"
    """Train alone for ``sync_every`` rounds, then step the shared parameters with the
    replicas' averaged (compressed) pseudo-gradients through an outer optimizer (DiLoCo)."""
    CUSTOM = "custom"
    """A user-supplied ``Synchronizer``."""
