"""paraloom on Apache Spark: DL4J's training masters, distributed evaluation and inference.

    from paraloom.spark import SparkModel, SharedTrainingMaster, AdaptiveThreshold
    master = SharedTrainingMaster(batch_size_per_worker=32, workers=2,
                                  threshold_algorithm=AdaptiveThreshold(1e-3))
    net = SparkModel(spark, model, master, loss_fn=nn.CrossEntropyLoss(), optimizer=opt)
    net.fit(train_rdd, epochs=3)

Needs the ``spark`` extra: ``pip install "paraloom[spark]"`` (PySpark 4, Java 17+).

Layout: ``model.py`` (SparkModel) and ``cli.py`` (``paraloom spark-train``) here;
``training/`` the two masters, their Spark tasks and the records those send the driver, the
barrier rendezvous and error board;
``evaluation/`` distributed evaluation (several metrics in one pass), inference; ``data/``
rows, DataFrames and Parquet (through Arrow) to arrays of one or several inputs, deterministic
partitions; ``stats/`` per-phase timings and TrainingStats;
``runtime/`` what both use on the executors (state as bytes, the model cache of an executor's
Python process).
"""

from __future__ import annotations

try:
    import pyspark  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("paraloom.spark needs PySpark: pip install \"paraloom[spark]\" (PySpark "
                      ">= 4.0, which needs Java 17 or later)") from e

from paraloom.evaluation import ROC, Evaluation
from paraloom.spark.evaluation import RegressionEvaluation
from paraloom.spark.model import SparkModel
from paraloom.spark.stats import PHASES, TrainingStats
from paraloom.spark.training import (
    NetworkSettings,
    ParameterAveragingTrainingMaster,
    SharedTrainingMaster,
    SparkTrainingError,
    TrainingMaster,
)
from paraloom.sync.pseudo_gradients import TopK
from paraloom.sync.thresholds import (
    AdaptiveThreshold,
    FixedThreshold,
    ResidualClipping,
    TargetSparsityThreshold,
)

__all__ = [
    "AdaptiveThreshold",
    "Evaluation",
    "FixedThreshold",
    "NetworkSettings",
    "PHASES",
    "ParameterAveragingTrainingMaster",
    "ROC",
    "RegressionEvaluation",
    "ResidualClipping",
    "SharedTrainingMaster",
    "SparkModel",
    "SparkTrainingError",
    "TargetSparsityThreshold",
    "TopK",
    "TrainingMaster",
    "TrainingStats",
]
