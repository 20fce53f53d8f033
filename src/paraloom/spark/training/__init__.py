"""The two training masters, their Spark tasks, the barrier rendezvous and the error board."""

from paraloom.spark.training.averaging import ParameterAveragingTrainingMaster
from paraloom.spark.training.master import FitJob, SparkTrainingError, TrainingMaster
from paraloom.spark.training.rendezvous import NetworkSettings
from paraloom.spark.training.shared import SharedTrainingMaster

__all__ = ["FitJob", "NetworkSettings", "ParameterAveragingTrainingMaster", "SharedTrainingMaster",
           "SparkTrainingError", "TrainingMaster"]
