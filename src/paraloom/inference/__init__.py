"""Thread-safe batched inference over model replicas: ParallelInference and its errors.

Stable names (``paraloom.serving`` relies on them): ``ParallelInference`` (``submit``,
``output``, ``output_async``, ``update_model``, ``model_version``, ``stats``, ``totals``,
``close``),
``InferenceMode``, and the errors ``QueueFullError`` (HTTP 503), ``InvalidRequestError``
(HTTP 400), ``RequestTimeoutError`` (504), ``InferenceClosedError`` (503),
``ModelUpdateError`` and their base ``InferenceError`` (500).
"""

from paraloom.inference.config import InferenceMode
from paraloom.inference.errors import (
    InferenceClosedError,
    InferenceError,
    InvalidRequestError,
    ModelUpdateError,
    QueueFullError,
    RequestTimeoutError,
)
from paraloom.inference.parallel import ParallelInference
from paraloom.precision import PRECISIONS, Precision

__all__ = [
    "PRECISIONS",
    "InferenceClosedError",
    "InferenceError",
    "InferenceMode",
    "InvalidRequestError",
    "ModelUpdateError",
    "ParallelInference",
    "Precision",
    "QueueFullError",
    "RequestTimeoutError",
]
