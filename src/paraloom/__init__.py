"""paraloom: data-parallel training and batched inference for PyTorch."""

from paraloom.checkpoint import load, register_model, save
from paraloom.errors import NotPicklableError, ParaloomError, WorkerError
from paraloom.sync.base import StepContext, Synchronizer
from paraloom.training.listeners import TrainingListener
from paraloom.training.modes import TrainingMode
from paraloom.training.wrapper import ParallelWrapper

__version__ = "0.1.0"

__all__ = [
    "NotPicklableError",
    "ParallelWrapper",
    "ParaloomError",
    "StepContext",
    "Synchronizer",
    "TrainingListener",
    "TrainingMode",
    "WorkerError",
    "load",
    "register_model",
    "save",
]
