"""Training statistics: per-phase timings recorded in the tasks, TrainingStats and its HTML page."""

from paraloom.spark.stats.recorder import PHASES, Event, PhaseRecorder, WorkerStats, split_round
from paraloom.spark.stats.timing import TimedSynchronizer, timed_collectives
from paraloom.spark.stats.training_stats import TrainingStats

__all__ = ["PHASES", "Event", "PhaseRecorder", "TimedSynchronizer", "TrainingStats", "WorkerStats",
           "split_round", "timed_collectives"]
