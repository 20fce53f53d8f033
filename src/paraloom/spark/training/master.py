"""What both training masters share: options, the fit inputs and outputs, running a Spark job."""

from __future__ import annotations

import re
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

import torch

from paraloom.errors import WorkerError
from paraloom.spark.data import Chunk, Features, Pair, partition_chunks
from paraloom.spark.data.partitions import spread_chunks
from paraloom.spark.runtime.interpreter import missing_paraloom_hint
from paraloom.spark.stats import TrainingStats
from paraloom.training.runner import WorkerSpec

if TYPE_CHECKING:
    from pyspark import RDD, SparkContext, StorageLevel

__all__ = ["TrainingMaster", "FitJob", "FitResult", "SparkTrainingError", "run_job", "root_cause",
           "storage_level_of", "REPARTITION", "positive_int", "positive_seconds"]

T = TypeVar("T")
REPARTITION = ("always", "if_needed", "never")


class SparkTrainingError(WorkerError):
    """Training on Spark failed; the message names the worker and the root cause.

    A ``WorkerError``, so code that handles ParallelWrapper's failures handles these too;
    ``attempts`` says how many times Spark ran the stage.
    """

    def __init__(self, message: str, *, worker: int | None = None,
                 remote_traceback: str | None = None, attempts: int | None = None) -> None:
        self.attempts = attempts
        super().__init__(message, worker=worker, remote_traceback=remote_traceback)


@dataclass
class FitJob:
    """What ``SparkModel.fit`` hands a master: the Spark context, the replica spec, the state."""

    sc: SparkContext
    spec: WorkerSpec
    state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any] | None
    features: Features
    fit_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    chunked: bool = False
    """The rows come as stacked chunks (Arrow-decoded DataFrames, Parquet paths)."""


@dataclass
class FitResult:
    """What a master returns: final parameters and optimizer state, a summary, the stats."""

    state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any] | None
    summary: dict[str, Any]
    stats: TrainingStats | None = None


def storage_level_of(level: StorageLevel | str | None) -> StorageLevel | None:
    """A pyspark StorageLevel from a StorageLevel, its name ("MEMORY_ONLY"), or None."""
    if level is None:
        return None
    from pyspark import StorageLevel

    if isinstance(level, StorageLevel):
        return level
    if isinstance(level, str) and isinstance(getattr(StorageLevel, level.upper(), None),
                                             StorageLevel):
        return getattr(StorageLevel, level.upper())
    names = [n for n in dir(StorageLevel) if n.isupper()]
    raise ValueError(f"storage_level={level!r}; expected None, a pyspark StorageLevel or one of "
                     f"{names}")


@overload
def positive_int(name: str, value: object, allow_none: Literal[False] = False) -> int: ...
@overload
def positive_int(name: str, value: object, allow_none: Literal[True]) -> int | None: ...
def positive_int(name: str, value: object, allow_none: bool = False) -> int | None:
    """``value`` if it is an int >= 1 (or None when allowed), else a ValueError naming it."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r}; expected an int >= 1")
    return value


@overload
def positive_seconds(name: str, value: object, allow_none: Literal[False] = False) -> float: ...
@overload
def positive_seconds(name: str, value: object, allow_none: Literal[True]) -> float | None: ...
def positive_seconds(name: str, value: object, allow_none: bool = False) -> float | None:
    """``value`` as float seconds if > 0 (or None when allowed), else a ValueError naming it."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name}={value!r}; expected seconds > 0")
    return float(value)


class TrainingMaster:
    """Base class: options every master has, validated at construction."""

    name = "master"

    def __init__(self, batch_size_per_worker: int, workers: int | None, *,
                 storage_level: StorageLevel | str | None = "MEMORY_ONLY",
                 repartition: str = "always",
                 job_timeout: float | None = None, prefetch_batches: int = 16) -> None:
        self.batch_size_per_worker = positive_int("batch_size_per_worker", batch_size_per_worker)
        self.prefetch_batches = positive_int("prefetch_batches", prefetch_batches)
        self.workers = positive_int("workers", workers, allow_none=True)
        storage_level_of(storage_level)  # a wrong name fails here, not at the first fit()
        self.storage_level = storage_level
        if repartition not in REPARTITION:
            raise ValueError(f"repartition={repartition!r}; expected one of {REPARTITION}")
        self.repartition = repartition
        self.job_timeout = positive_seconds("job_timeout", job_timeout, allow_none=True)

    def window_rows(self) -> int:
        """Rows a worker reads ahead, shuffles and holds at once: ``prefetch_batches``
        minibatches (DL4J's workerPrefetchNumBatches); memory does not grow with the data."""
        return self.prefetch_batches * self.batch_size_per_worker

    def resolve_workers(self, sc: SparkContext) -> int:
        """``workers``, or every task slot of the cluster (default parallelism / task CPUs)."""
        cpus = int(sc.getConf().get("spark.task.cpus", "1"))
        slots = max(1, sc.defaultParallelism // max(1, cpus))
        return self.workers or slots

    def prepare(self, rows: RDD[Pair], workers: int, chunked: bool = False) -> RDD[Chunk]:
        """The training rows (or chunks) as ``workers`` sorted partitions of chunks, persisted
        if asked."""
        data = (spread_chunks(rows, workers, self.repartition) if chunked
                else partition_chunks(rows, workers, self.repartition))
        level = storage_level_of(self.storage_level)
        if level is not None:
            data.persist(level)
        return data

    def fit(self, job: FitJob, rows: RDD[Pair], *, epochs: int, seed: int,
            collect_stats: bool) -> FitResult:
        raise NotImplementedError

    def __repr__(self) -> str:
        keys = [k for k in vars(self) if not k.startswith("_")]
        return f"{type(self).__name__}({', '.join(f'{k}={getattr(self, k)!r}' for k in keys)})"


def _attempts(sc: SparkContext, group: str) -> int:
    """Most attempts any stage of the group's jobs needed (1 when nothing was retried)."""
    tracker = sc.statusTracker()
    most = 0
    for job_id in tracker.getJobIdsForGroup(group):
        info = tracker.getJobInfo(job_id)
        for stage_id in (info.stageIds if info else []):
            stage = tracker.getStageInfo(stage_id)
            if stage is not None:
                most = max(most, stage.currentAttemptId)
    return most + 1


def root_cause(text: str) -> str:
    """The useful lines of a Spark job failure: the abort reason, its cause, the Python error."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    at = next((i for i, ln in enumerate(lines) if "Job aborted due to stage failure" in ln), None)
    keep = []
    if at is not None:
        keep.append(lines[at][lines[at].index("Job aborted"):])
        cause = next((ln for ln in lines[at + 1:] if re.search(r"(Exception|Error)\b: ", ln)),
                     None)
        if cause:
            keep.append(cause)
    python = [ln for ln in lines if re.match(r"^[A-Za-z_.]*(Error|Exception|Exit)\b.*:", ln)
              and not ln.startswith(("org.", "java.", "py4j", "Caused by"))]
    if python and python[-1] not in keep:
        keep.append(python[-1])
    return "\n".join(keep) if keep else (lines[-1] if lines else text)


def run_job(sc: SparkContext, action: Callable[[], T], description: str,
            timeout_s: float | None = None) -> tuple[T, int]:
    """Run a Spark action in its own job group: (result, stage attempts).

    With ``timeout_s`` the group is cancelled when time is up. A failure becomes a
    SparkTrainingError that says how many stage attempts Spark made and why the last failed.
    """
    group = f"paraloom-{uuid.uuid4().hex[:12]}"
    sc.setJobGroup(group, description, interruptOnCancel=True)
    timed_out = threading.Event()

    def cancel() -> None:
        timed_out.set()
        sc.cancelJobGroup(group)

    timer = threading.Timer(timeout_s, cancel) if timeout_s else None
    if timer is not None:
        timer.daemon = True
        timer.start()
    try:
        result = action()
    except Exception as e:
        attempts = _attempts(sc, group)
        if timed_out.is_set():
            raise SparkTrainingError(f"{description} did not finish within job_timeout="
                                     f"{timeout_s:g} s and was cancelled", attempts=attempts) from e
        hint = missing_paraloom_hint(str(e), getattr(sc, "pythonExec", "python3"))
        raise SparkTrainingError(f"{description} failed after {attempts} stage attempt(s): "
                                 f"{root_cause(str(e))}" + (f"\n{hint}" if hint else ""),
                                 attempts=attempts) from e
    finally:
        if timer is not None:
            timer.cancel()
        # None unsets a property (pyspark documents it; its type hint says str only).
        sc.setLocalProperty("spark.jobGroup.id", None)  # type: ignore[arg-type]
        sc.setLocalProperty("spark.job.description", None)  # type: ignore[arg-type]
    return result, _attempts(sc, group)
