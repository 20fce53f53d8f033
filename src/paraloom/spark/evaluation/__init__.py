"""Distributed evaluation and inference: the model shipped once per job, mergeable metrics."""

from paraloom.spark.evaluation.frames import predict_dataframe
from paraloom.spark.evaluation.inference import (
    evaluate_metrics,
    evaluate_rdd,
    predict_rdd,
    ship,
)
from paraloom.spark.evaluation.metrics import RegressionEvaluation

__all__ = ["RegressionEvaluation", "evaluate_metrics", "evaluate_rdd", "predict_dataframe",
           "predict_rdd", "ship"]
