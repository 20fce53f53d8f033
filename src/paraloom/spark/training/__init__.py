"""DL4J's two training masters, their Spark tasks and what those send the driver
(``messages.py``), the barrier rendezvous and the error board; ``base.py`` holds the masters'
base class, ``jobs.py`` a fit's inputs and outputs and how a Spark job runs."""

from paraloom.spark.training.averaging import ParameterAveragingTrainingMaster
from paraloom.spark.training.base import TrainingMaster
from paraloom.spark.training.jobs import FitJob, SparkTrainingError
from paraloom.spark.training.rendezvous import NetworkSettings
from paraloom.spark.training.shared import SharedTrainingMaster

__all__ = ["FitJob", "NetworkSettings", "ParameterAveragingTrainingMaster", "SharedTrainingMaster",
           "SparkTrainingError", "TrainingMaster"]
