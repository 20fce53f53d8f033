"""A fit as Spark jobs: what ``SparkModel.fit`` hands a training master, what it gets back, and
``run_job``, which runs one Spark action and turns its failure into a ``SparkTrainingError``."""

from __future__ import annotations

import re
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from paraloom.errors import WorkerError
from paraloom.spark.data import Columns, Features
from paraloom.spark.runtime.interpreter import missing_paraloom_hint
from paraloom.spark.runtime.state import OptimizerState
from paraloom.spark.stats import TrainingStats
from paraloom.spark.training.summary import Summary
from paraloom.training.messages import ModelState
from paraloom.training.runner import WorkerSpec

if TYPE_CHECKING:
    from pyspark import SparkContext

__all__ = ["FitJob", "FitResult", "SparkTrainingError", "run_job", "root_cause"]

T = TypeVar("T")


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
    """What ``SparkModel.fit`` hands a training master: the Spark context, the replica spec,
    and the user's model and optimizer state to start from."""

    sc: SparkContext
    spec: WorkerSpec
    state: ModelState
    optimizer_state: OptimizerState | None
    features: Features
    fit_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    chunked: bool = False
    """The rows come as stacked chunks (Arrow-decoded DataFrames, Parquet paths)."""
    columns: Columns | None = None
    """The columns read (DataFrames and Parquet paths)."""
    from_files: bool = False
    """A DataFrame of Parquet files read as they are: its partitions are Spark's bins of the
    files (unequal rows), not partitions the user chose, so they are spread over the workers
    even when there are as many as workers."""


@dataclass
class FitResult:
    """What a training master returns: final parameters and optimizer state, a summary (what
    ``SparkModel.fit`` returns), the stats."""

    state: ModelState
    optimizer_state: OptimizerState | None
    summary: Summary
    stats: TrainingStats | None = None


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


_JVM_LINES = ("at ", "org.", "java.", "py4j", "Caused by", "Driver stacktrace", "...",
              "Traceback", "File ")


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
        # The error's own further lines (the batch it failed on, the fix), not Java's frames.
        after = len(lines) - 1 - lines[::-1].index(python[-1])
        for line in lines[after + 1:after + 5]:
            if line.startswith(_JVM_LINES):
                break
            keep.append(line)
    if keep:
        return "\n".join(keep)
    # No abort line nor Python error (Spark refused the job itself): its exception, not the
    # last of the JVM's frames.
    thrown = [ln.lstrip(": ") for ln in lines if re.search(r"(Exception|Error)\b: ", ln)]
    inner = [ln for ln in thrown if not ln.startswith("py4j")]  # py4j's only wraps it
    if thrown:
        return (inner or thrown)[0]
    return lines[-1] if lines else text


def _job_failure(sc: SparkContext, error: Exception, description: str, attempts: int,
                 timeout_s: float | None) -> SparkTrainingError:
    """The SparkTrainingError for a failed action: cancelled at ``job_timeout``, or the last
    attempt's root cause (with the fix when the executors' Python lacks paraloom)."""
    if timeout_s is not None:
        return SparkTrainingError(f"{description} did not finish within job_timeout="
                                  f"{timeout_s:g} s and was cancelled", attempts=attempts)
    hint = missing_paraloom_hint(str(error), getattr(sc, "pythonExec", "python3"))
    return SparkTrainingError(f"{description} failed after {attempts} stage attempt(s): "
                              f"{root_cause(str(error))}" + (f"\n{hint}" if hint else ""),
                              attempts=attempts)


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
        raise _job_failure(sc, e, description, _attempts(sc, group),
                           timeout_s if timed_out.is_set() else None) from e
    finally:
        if timer is not None:
            timer.cancel()
        # None unsets a property (pyspark documents it; its type hint says str only).
        sc.setLocalProperty("spark.jobGroup.id", None)  # type: ignore[arg-type]
        sc.setLocalProperty("spark.job.description", None)  # type: ignore[arg-type]
    return result, _attempts(sc, group)
