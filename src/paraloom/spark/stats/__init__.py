"""Training statistics: per-phase timings recorded in the tasks, TrainingStats and its HTML page."""

from paraloom.spark.stats.recorder import PHASES, PhaseRecorder, split_round
from paraloom.spark.stats.timing import TimedSynchronizer, timed_collectives
from paraloom.spark.stats.training_stats import TrainingStats

__all__ = ["PHASES", "PhaseRecorder", "TimedSynchronizer", "TrainingStats", "split_round",
           "timed_collectives"]
