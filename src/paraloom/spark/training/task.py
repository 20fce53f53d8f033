"""Pieces both masters' Spark tasks use: the replica, minibatches, failure records."""

from __future__ import annotations

import traceback
from dataclasses import dataclass, replace

import cloudpickle

from paraloom.spark.data import Features, Pair, Tensors
from paraloom.spark.stats import PhaseRecorder, TimedSynchronizer
from paraloom.spark.training.messages import WorkerFailed
from paraloom.training.failures import is_symptom
from paraloom.training.runner import ReplicaRunner, WorkerSpec
from paraloom.training.runner import pickle_spec as pickle_for_workers

__all__ = ["failure", "load_spec", "make_runner", "batch_tensors", "EpochLoss", "pickle_spec"]


def failure(rank: int, error: BaseException | str, tb: str | None = None, *,
            cause_rank: int | None = None) -> WorkerFailed:
    """A failed worker's record: message, traceback, and whether it is a mere symptom.

    ``cause_rank``: the error is another rank's, relayed (that rank may not report itself).
    """
    message = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    if tb is None and isinstance(error, BaseException):
        tb = "".join(traceback.format_exception(error))
    symptom = cause_rank is not None or is_symptom(message)
    return WorkerFailed(rank, message, tb or "", symptom, cause_rank)


def load_spec(spec_bytes: bytes) -> WorkerSpec:
    """The replica spec the driver cloudpickled (model, optimizer, loss, synchronizer)."""
    spec = cloudpickle.loads(spec_bytes)
    if not isinstance(spec, WorkerSpec):
        raise TypeError(f"expected a WorkerSpec from the driver, got {type(spec).__name__}")
    return spec


def make_runner(spec: WorkerSpec, *, rank: int, world_size: int, device: str,
                recorder: PhaseRecorder | None) -> ReplicaRunner:
    """A ReplicaRunner; with a recorder its synchronizer's step hooks are timed."""
    if recorder is not None:
        spec = replace(spec, synchronizer=TimedSynchronizer(spec.synchronizer))
    runner = ReplicaRunner(spec, rank=rank, world_size=world_size, device=device)
    sync = runner.replica.sync
    if isinstance(sync, TimedSynchronizer):
        sync.recorder = recorder  # the replica holds its own copy: point that one at us
    return runner


def batch_tensors(arrays: Pair, features: Features) -> tuple[Tensors, Tensors]:
    """A minibatch's ``(features, labels)`` arrays as (inputs, targets) tensors (tuples for
    several)."""
    return features.features(arrays[0]), features.labels(arrays[1])


@dataclass
class EpochLoss:
    """Loss sum (loss times rows) and rows per epoch on one worker."""

    sums: dict[int, float]
    rows: dict[int, int]

    @classmethod
    def empty(cls) -> EpochLoss:
        return cls({}, {})

    def add(self, epoch: int, loss: float | None, rows: int) -> None:
        if loss is None or not rows:
            return
        self.sums[epoch] = self.sums.get(epoch, 0.0) + loss * rows
        self.rows[epoch] = self.rows.get(epoch, 0) + rows

    def by_epoch(self) -> dict[int, tuple[float, int]]:
        """(loss sum, rows) per epoch, in epoch order (``WorkerReport.losses``)."""
        return {e: (self.sums[e], self.rows[e]) for e in sorted(self.sums)}


def pickle_spec(spec: WorkerSpec) -> bytes:
    """cloudpickle the spec for the executors, naming the part that cannot be pickled."""
    return pickle_for_workers(
        spec, destination="the Spark executors",
        hint="Keep open files, locks, threads, sockets and the SparkSession out of it; define "
             "classes and functions at module level or in the notebook")
