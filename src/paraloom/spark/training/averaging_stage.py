"""The averaging master's fit in one barrier stage: every averaging round inside one Spark stage.

The tasks train ``averaging_frequency`` minibatches each, then average their parameters (and
the optimizer state with ``save_updater=True``) with one all-reduce among themselves, as
ParallelWrapper's averaging mode does, instead of sending them to the driver in one Spark job
per round. With ``save_updater=False`` each round restarts from the optimizer's initial state
(DL4J's default). Rank 0 checkpoints only right after an averaging, where every replica holds
the same state, so a re-run stage resumes exactly.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from paraloom.spark.data.parquet import ParquetSet
from paraloom.spark.runtime import unpack
from paraloom.spark.training.barrier import StageRun, run_barrier_stage
from paraloom.spark.training.jobs import FitJob, FitResult
from paraloom.spark.training.messages import WorkerReport
from paraloom.spark.training.shared_task import SharedConfig
from paraloom.spark.training.summary import (
    AveragingSummary,
    dense_bytes_per_step,
    epoch_losses,
    last_first_step,
)
from paraloom.sync.averaging import Averaging
from paraloom.sync.base import StepContext

if TYPE_CHECKING:
    from pyspark import RDD

    from paraloom.spark.data import Chunk

__all__ = ["RoundAveraging", "fit_in_one_stage", "stage_summary"]


class RoundAveraging(Averaging):
    """``Averaging`` with DL4J's ``saveUpdater``: True averages the optimizer state with the
    parameters; False restarts it from its initial state after every averaging.

    As ``Averaging`` does, each replica counts in proportion to the minibatches it trained since
    the last averaging (the per-round path weights by examples): a task whose partition has run
    out of rows (or held none) is left out, where a plain mean would pull every averaging back
    towards its stale weights (with one of two tasks empty, training at half the learning
    rate)."""

    def __init__(self, frequency: int, save_updater: bool) -> None:
        super().__init__(frequency, average_updaters=save_updater)

    def average(self, ctx: StepContext) -> None:
        super().average(ctx)
        if not self.average_updaters:
            ctx.optimizer.state.clear()


def fit_in_one_stage(job: FitJob, data: RDD[Chunk] | ParquetSet, cfg: SharedConfig,
                     frequency: int, save_updater: bool,
                     job_timeout: float | None) -> FitResult:
    """Train the fit's every averaging round in one barrier stage; the averaged result."""
    sync = RoundAveraging(frequency, save_updater)
    job = replace(job, spec=replace(job.spec, synchronizer=sync))
    run = run_barrier_stage(job, data, cfg, "ParameterAveragingTrainingMaster", job_timeout)
    packed = unpack(run.outcome.state)
    summary = stage_summary(run, job, cfg, frequency, save_updater)
    stats = run.stats("ParameterAveragingTrainingMaster", summary) if cfg.collect_stats \
        else None
    return FitResult(packed.model, packed.optimizer if save_updater else None, summary, stats)


def _mean(reports: list[WorkerReport], key: str) -> float:
    return sum(r.sync.get(key, 0.0) for r in reports) / max(1, len(reports))


def stage_summary(run: StageRun, job: FitJob, cfg: SharedConfig, frequency: int,
                  save_updater: bool) -> AveragingSummary:
    """The averaging master's summary (same keys as the per-round path's) from the reports."""
    reports = [run.outcome.reports[r] for r in sorted(run.outcome.reports)]
    samples = sum(r.samples for r in reports)
    steps = sum(r.steps for r in reports)
    losses = epoch_losses([r.losses for r in reports])
    per_step = _mean(reports, "bytes_sent_per_step")
    return AveragingSummary(
        master="averaging", workers=cfg.world_size, epochs=cfg.epochs,
        batch_size_per_worker=cfg.batch_size, averaging_frequency=frequency,
        save_updater=save_updater, encoding=None, outer_optimizer=None,
        rounds=int(reports[0].sync.get("averagings", 0)), samples=samples, steps=steps,
        seconds=run.seconds, samples_per_s=samples / max(run.seconds, 1e-9),
        loss=losses[-1] if losses else None, epoch_losses=losses,
        bytes_per_step_per_worker=2 * per_step, bytes_sent_per_step_per_worker=per_step,
        bytes_received_per_step_per_worker=per_step,
        dense_bytes_per_step=dense_bytes_per_step(job.spec.model, cfg.world_size),
        stage_attempts=run.attempts,
        worker_peak_rss_mb=max(r.peak_rss for r in reports) / 2**20,
        rows_per_worker=[r.rows for r in reports],
        stages="one", seconds_to_first_step=last_first_step(reports))
