"""paraloom: data-parallel training and batched inference for PyTorch."""

from paraloom._version import __version__ as __version__
from paraloom.checkpoint import load, register_model, save
from paraloom.early_stopping import (
    EarlyStoppingConfig,
    EarlyStoppingParallelTrainer,
    EarlyStoppingResult,
)
from paraloom.errors import NotPicklableError, ParaloomError, WorkerError
from paraloom.inference import (
    InferenceClosedError,
    InferenceError,
    InferenceMode,
    InvalidRequestError,
    ModelUpdateError,
    ParallelInference,
    QueueFullError,
    RequestTimeoutError,
)
from paraloom.listeners import TrainingListener
from paraloom.sync import (
    AdaptiveThreshold,
    FixedThreshold,
    ResidualClipping,
    TargetSparsityThreshold,
)
from paraloom.sync.base import StepContext, Synchronizer
from paraloom.training.modes import TrainingMode
from paraloom.training.resume import TrainingCheckpoint
from paraloom.training.wrapper import ParallelWrapper

__all__ = [
    "AdaptiveThreshold",
    "EarlyStoppingConfig",
    "EarlyStoppingParallelTrainer",
    "EarlyStoppingResult",
    "FixedThreshold",
    "InferenceClosedError",
    "InferenceError",
    "InferenceMode",
    "InvalidRequestError",
    "ModelUpdateError",
    "NotPicklableError",
    "ParallelInference",
    "ParallelWrapper",
    "ParaloomError",
    "QueueFullError",
    "RequestTimeoutError",
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
