"""paraloom: data-parallel training and batched inference for PyTorch.

The public names load on first use (PEP 562), so ``import paraloom.serving`` does not pull in
the training engine, nor ``import paraloom.training`` the inference server.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import TYPE_CHECKING

from paraloom._version import __version__ as __version__

if TYPE_CHECKING:
    from paraloom.checkpoint import load, register_model, save
    from paraloom.early_stopping import (
        EarlyStoppingConfig,
        EarlyStoppingParallelTrainer,
        EarlyStoppingResult,
    )
    from paraloom.errors import FitInterrupted, NotPicklableError, ParaloomError, WorkerError
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
    from paraloom.sharding import ReplicaInfo, replica_info
    from paraloom.sync import (
        AdaptiveThreshold,
        FixedThreshold,
        QuantileThreshold,
        ResidualClipping,
        TargetSparsityThreshold,
    )
    from paraloom.sync.base import StepContext, Synchronizer
    from paraloom.sync.sharing import SharingRecipe
    from paraloom.training.modes import TrainingMode
    from paraloom.training.options import FaultTolerance, LoopOptions, StepOptions
    from paraloom.training.resume import TrainingCheckpoint
    from paraloom.training.wrapper import ParallelWrapper

_WHERE = {
    "load": "paraloom.checkpoint", "register_model": "paraloom.checkpoint",
    "save": "paraloom.checkpoint",
    "EarlyStoppingConfig": "paraloom.early_stopping",
    "EarlyStoppingParallelTrainer": "paraloom.early_stopping",
    "EarlyStoppingResult": "paraloom.early_stopping",
    "FitInterrupted": "paraloom.errors", "NotPicklableError": "paraloom.errors",
    "ParaloomError": "paraloom.errors",
    "WorkerError": "paraloom.errors",
    "InferenceClosedError": "paraloom.inference", "InferenceError": "paraloom.inference",
    "InferenceMode": "paraloom.inference", "InvalidRequestError": "paraloom.inference",
    "ModelUpdateError": "paraloom.inference", "ParallelInference": "paraloom.inference",
    "QueueFullError": "paraloom.inference", "RequestTimeoutError": "paraloom.inference",
    "TrainingListener": "paraloom.listeners",
    "ReplicaInfo": "paraloom.sharding", "replica_info": "paraloom.sharding",
    "AdaptiveThreshold": "paraloom.sync", "FixedThreshold": "paraloom.sync",
    "QuantileThreshold": "paraloom.sync", "ResidualClipping": "paraloom.sync",
    "TargetSparsityThreshold": "paraloom.sync",
    "StepContext": "paraloom.sync.base", "Synchronizer": "paraloom.sync.base",
    "SharingRecipe": "paraloom.sync.sharing",
    "FaultTolerance": "paraloom.training.options", "LoopOptions": "paraloom.training.options",
    "StepOptions": "paraloom.training.options",
    "TrainingMode": "paraloom.training.modes",
    "TrainingCheckpoint": "paraloom.training.resume",
    "ParallelWrapper": "paraloom.training.wrapper",
}

__all__ = [
    "AdaptiveThreshold",
    "EarlyStoppingConfig",
    "EarlyStoppingParallelTrainer",
    "EarlyStoppingResult",
    "FaultTolerance",
    "FitInterrupted",
    "FixedThreshold",
    "InferenceClosedError",
    "InferenceError",
    "InferenceMode",
    "InvalidRequestError",
    "LoopOptions",
    "ModelUpdateError",
    "NotPicklableError",
    "ParallelInference",
    "ParallelWrapper",
    "ParaloomError",
    "QuantileThreshold",
    "QueueFullError",
    "ReplicaInfo",
    "RequestTimeoutError",
    "ResidualClipping",
    "SharingRecipe",
    "StepContext",
    "StepOptions",
    "Synchronizer",
    "TargetSparsityThreshold",
    "TrainingCheckpoint",
    "TrainingListener",
    "TrainingMode",
    "WorkerError",
    "load",
    "register_model",
    "replica_info",
    "save",
]


_SUBMODULES = frozenset(m.name for m in pkgutil.iter_modules(__path__))


def __getattr__(name: str) -> object:
    """A public name, or a submodule (``paraloom.sync``, ``paraloom.models``), on first use."""
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"paraloom.{name}")
    else:
        raise AttributeError(f"module 'paraloom' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE, *_SUBMODULES})
