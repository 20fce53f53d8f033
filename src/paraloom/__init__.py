"""paraloom: data-parallel training and batched inference for PyTorch."""

from paraloom.checkpoint import load, register_model, save
from paraloom.errors import NotPicklableError, ParaloomError, WorkerError
from paraloom.sync.base import StepContext, Synchronizer

__version__ = "0.1.0"

__all__ = [
    "NotPicklableError",
    "ParaloomError",
    "StepContext",
    "Synchronizer",
    "WorkerError",
    "load",
    "register_model",
    "save",
]
