"""paraloom: data-parallel training and batched inference for PyTorch."""

from paraloom.checkpoint import load, register_model, save
from paraloom.early_stopping import (
    EarlyStoppingConfig,
    EarlyStoppingParallelTrainer,
    EarlyStoppingResult,
)
from paraloom.errors import NotPicklableError, ParaloomError, WorkerError
from paraloom.training.resume import TrainingCheckpoint
from paraloom.sync import (
    AdaptiveThreshold,
    FixedThreshold,
    ResidualClipping,
    TargetSparsityThreshold,
)
from paraloom.sync.base import StepContext, Synchronizer
from paraloom.listeners import TrainingListener
from paraloom.training.modes import TrainingMode
from paraloom.training.wrapper import ParallelWrapper

__version__ = "0.1.0"

__all__ = [
    "AdaptiveThreshold",
    "EarlyStoppingConfig",
    "EarlyStoppingParallelTrainer",
    "EarlyStoppingResult",
    "FixedThreshold",
    "NotPicklableError",
    "ParallelWrapper",
    "ParaloomError",
    "ResidualClipping",
    "StepContext",
    "Synchronizer",
    "TargetSparsityThreshold",
    "TrainingCheckpoint",
    "TrainingListener",
    "TrainingMode",
    "WorkerError",
    "load",
    "register_model",
    "save",
]
