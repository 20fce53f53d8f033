"""Training statistics: per-phase timings recorded in the tasks, TrainingStats and its HTML page."""

from paraloom.spark.stats.recorder import (
    PHASES,
    PhaseRecorder,
    TimedSynchronizer,
    TrainingStats,
    split_round,
    timed_collectives,
)

__all__ = ["PHASES", "PhaseRecorder", "TimedSynchronizer", "TrainingStats", "split_round",
           "timed_collectives"]
