"""A whole fit in one Spark barrier stage: what both training masters run on DataFrames and
Parquet paths.

One barrier task per worker runs ``shared_task`` with the master's synchronizer
(``SharedGradients`` for the shared master, ``Averaging`` for the averaging master): the tasks
meet once through ``BarrierTaskContext.allGather``, form a torch.distributed group and train
every epoch of the fit, exchanging among themselves. The rows come from the task's partition of
a prepared RDD (stored on the executor's local disk as they stream in) or straight from its
share of Parquet row groups (``ParquetShare``: nothing stored, shuffled or counted).

A shuffle after the stage makes it a ShuffleMapStage, which Spark re-runs as a whole when a task
dies (a barrier ResultStage is never retried); the re-run resumes from rank 0's last
checkpoint, taken where the replicas agreed.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from paraloom.spark.data import Chunk, Columns
from paraloom.spark.data.parquet import ParquetSet
from paraloom.spark.data.sources import ParquetShare, TaskData
from paraloom.spark.runtime import pack
from paraloom.spark.stats import Event, TrainingStats
from paraloom.spark.training.jobs import FitJob, SparkTrainingError, run_job
from paraloom.spark.training.messages import (
    TaskRecord,
    WorkerFailed,
    WorkerFinished,
    WorkerReport,
    WorkerRerun,
)
from paraloom.spark.training.shared_task import SharedConfig, checkpoint_path, shared_task
from paraloom.spark.training.task import pickle_spec

if TYPE_CHECKING:
    from pyspark import RDD

__all__ = ["StageRun", "StageOutcome", "run_barrier_stage", "stage_outcome"]


@dataclass(frozen=True)
class StageOutcome:
    """What a barrier stage that trained to the end produced."""

    reports: dict[int, WorkerReport]
    """Every worker's report by rank (a worker re-run alone after the fit sends none)."""
    state: bytes
    """Rank 0's final parameters and optimizer state, ``pack``ed."""


@dataclass(frozen=True)
class StageRun:
    """A finished barrier stage: its outcome, how many attempts it took, and when."""

    outcome: StageOutcome
    attempts: int
    launched: float
    """Seconds from the fit's start to the stage's launch."""
    seconds: float
    """Seconds the stage ran, from launch to the last record."""

    def stats(self, master: str, summary: Mapping[str, object]) -> TrainingStats:
        """The stage's ``TrainingStats``: every worker's phase timings and the stage as one
        event (``fit(collect_stats=True)``)."""
        reports = self.outcome.reports
        per_worker = [timings for r in sorted(reports) if (timings := reports[r].stats)]
        return TrainingStats(master, per_worker,
                             [Event(name="barrier stage", start=self.launched,
                                    duration=self.seconds)], summary)


def _parquet_source(data: ParquetSet, columns: Columns, cfg: SharedConfig,
                    chunk_rows: int) -> TaskData:
    from pyspark import BarrierTaskContext

    rank = BarrierTaskContext.get().partitionId()
    return ParquetShare(data, columns, rank=rank, world=cfg.world_size, seed=cfg.seed,
                        chunk_rows=chunk_rows)


def run_barrier_stage(job: FitJob, rows: RDD[Chunk] | ParquetSet, cfg: SharedConfig,
                      master: str, job_timeout: float | None) -> StageRun:
    """Train the whole fit in one barrier stage of ``cfg.world_size`` tasks; ``job.spec``
    carries the synchronizer. ``rows``: the prepared partitions (one per worker), or a
    Parquet set that each task reads its share of. ``master`` names the training master in
    the job's description and in errors."""
    from pyspark import BarrierTaskContext

    sc = job.sc
    spec_bc = sc.broadcast(pickle_spec(job.spec))
    state_bc = sc.broadcast(pack(job.state, job.optimizer_state))
    if isinstance(rows, ParquetSet):
        if job.columns is None:
            raise ValueError("a Parquet fit needs the FitJob's columns")
        source = partial(_parquet_source, rows, job.columns, cfg, max(4096, cfg.window_rows))
        tasks: RDD[Any] = sc.parallelize(range(cfg.world_size), cfg.world_size)
    else:
        source, tasks = None, rows

    def run(chunks: Iterable[Any]) -> Iterator[TaskRecord]:
        return shared_task(spec_bc.value, state_bc.value, cfg, BarrierTaskContext.get(),
                           chunks, source)

    # The shuffle after the barrier stage is what lets Spark re-run it when a task dies.
    stage = tasks.barrier().mapPartitions(run).map(lambda r: (r.rank, r)).partitionBy(1)
    start, launched = time.perf_counter(), time.time() - cfg.origin
    try:
        description = f"paraloom {master}.fit ({cfg.world_size} workers, {cfg.epochs} epochs)"
        records, attempts = run_job(sc, stage.values().collect, description, job_timeout)
    finally:
        for handle in (spec_bc, state_bc):
            handle.unpersist()
        if not isinstance(rows, ParquetSet):
            rows.unpersist()
        checkpoint_path(cfg.checkpoint_dir or "", job.fit_id).unlink(missing_ok=True)
    seconds = time.perf_counter() - start
    return StageRun(stage_outcome(records, cfg.world_size, attempts, master), attempts, launched,
                    seconds)


def stage_outcome(records: Iterable[TaskRecord], world_size: int, attempts: int,
                  master: str = "SharedTrainingMaster") -> StageOutcome:
    """The driver's dispatcher: a barrier stage's records as its outcome, or the
    SparkTrainingError to raise (a worker's error; or reports missing, the stage lost them)."""
    reports: dict[int, WorkerReport] = {}
    failures: list[WorkerFailed] = []
    reran: list[int] = []
    state = b""
    for record in records:
        match record:
            case WorkerFailed():
                failures.append(record)
            case WorkerRerun():  # re-run alone after the others had finished the fit
                reran.append(record.rank)
            case WorkerFinished():
                reports[record.rank] = record.report
                state = record.state if record.rank == 0 else state
    if failures:
        raise _training_error(failures, attempts, master)
    if sorted([*reports, *reran]) != list(range(world_size)) or not state:
        raise SparkTrainingError(f"{master}: expected reports from workers "
                                 f"0..{world_size - 1}, got {sorted(reports)}; the stage lost "
                                 f"results, run fit() again", attempts=attempts)
    return StageOutcome(reports, state)


def _training_error(failures: list[WorkerFailed], attempts: int,
                    master: str) -> SparkTrainingError:
    """The error to raise: a rank's own failure first, else one that a peer relayed."""
    first = min(failures, key=lambda f: (f.symptom, f.cause_rank is None, f.rank))
    worker = first.rank if first.cause_rank is None else first.cause_rank
    return SparkTrainingError(f"{master}: worker {worker} failed: {first.message}", worker=worker,
                              remote_traceback=first.traceback, attempts=attempts)
