"""How replicas stay consistent: one synchronizer per file, resolved from ``training_mode``."""

from paraloom.sync.allreduce import AllReduce
from paraloom.sync.averaging import Averaging
from paraloom.sync.base import NoSync, StepContext, Synchronizer
from paraloom.sync.compressed import Fp16AllReduce
from paraloom.sync.diloco import DiLoCo, averaging_outer_optimizer, nesterov_outer_optimizer
from paraloom.sync.registry import build_synchronizer, training_modes
from paraloom.sync.sharing import SharedGradients, SharingRecipe
from paraloom.sync.thresholds import (
    AdaptiveThreshold,
    FixedThreshold,
    QuantileThreshold,
    ResidualClipping,
    ResidualPostProcessor,
    TargetSparsityThreshold,
    ThresholdAlgorithm,
)

__all__ = [
    "AdaptiveThreshold", "AllReduce", "Averaging", "DiLoCo", "FixedThreshold", "Fp16AllReduce",
    "NoSync", "averaging_outer_optimizer", "nesterov_outer_optimizer",
    "QuantileThreshold", "ResidualClipping", "ResidualPostProcessor", "SharedGradients",
    "SharingRecipe",
    "StepContext", "Synchronizer", "TargetSparsityThreshold", "ThresholdAlgorithm",
    "build_synchronizer", "training_modes",
]
