"""Early stopping for parallel training: the trainer, its conditions, calculators and savers."""

from paraloom.training.conditions import (
    BestScore,
    EpochTerminationCondition,
    IterationTerminationCondition,
    MaxEpochs,
    MaxScore,
    MaxTime,
    ScoreImprovement,
)
from paraloom.training.early_stopping import (
    EarlyStoppingConfig,
    EarlyStoppingParallelTrainer,
    EarlyStoppingResult,
)
from paraloom.training.savers import InMemoryModelSaver, LocalDirectorySaver, ModelSaver
from paraloom.training.scores import (
    AccuracyCalculator,
    CallableCalculator,
    F1Calculator,
    LossCalculator,
    MSECalculator,
    ScoreCalculator,
)

__all__ = [
    "AccuracyCalculator", "BestScore", "CallableCalculator", "EarlyStoppingConfig",
    "EarlyStoppingParallelTrainer", "EarlyStoppingResult", "EpochTerminationCondition",
    "F1Calculator", "InMemoryModelSaver", "IterationTerminationCondition", "LocalDirectorySaver",
    "LossCalculator", "MSECalculator", "MaxEpochs", "MaxScore", "MaxTime", "ModelSaver",
    "ScoreCalculator", "ScoreImprovement",
]
