"""ParameterAveragingTrainingMaster: one ordinary Spark job per averaging round (DL4J's design).

Each averaging round broadcasts the parameters (and the optimizer state with
``save_updater=True``), every partition trains ``averaging_frequency`` minibatches of
``batch_size_per_worker`` rows from where the previous averaging round stopped, and the driver
averages what the tasks return with ``treeAggregate``, weighted by the examples each trained.
No barrier, no collectives: a failed task is simply retried by Spark.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING

import numpy as np

from paraloom.spark.data import Chunk, Pair, batch_count, num_rows
from paraloom.spark.data.parquet import ParquetSet
from paraloom.spark.runtime import join_optimizer_state, pack, unflatten
from paraloom.spark.stats import Event, TrainingStats, WorkerStats
from paraloom.spark.training.averaging_stage import fit_in_one_stage
from paraloom.spark.training.averaging_task import (
    AveragingRound,
    add_results,
    averaging_task,
    weighted,
)
from paraloom.spark.training.base import TrainingMaster, positive_int, positive_seconds
from paraloom.spark.training.diloco import OuterStep, resolve_diloco, state_update
from paraloom.spark.training.diloco_task import remove_local, trainable_names
from paraloom.spark.training.jobs import FitJob, FitResult, run_job
from paraloom.spark.training.messages import AveragingSums
from paraloom.spark.training.shared_task import SharedConfig
from paraloom.spark.training.summary import AveragingRoundTotals, averaging_summary
from paraloom.spark.training.task import pickle_spec
from paraloom.sync.base import NoSync
from paraloom.sync.diloco import OuterOptimizer, describe_factory
from paraloom.sync.pseudo_gradients import TopK

if TYPE_CHECKING:
    from pyspark import RDD, Broadcast, SparkContext, StorageLevel

__all__ = ["ParameterAveragingTrainingMaster"]


def _rows(chunks: Iterable[Chunk]) -> list[int]:
    return [sum(num_rows(x) for x, _ in chunks)]  # one chunk at a time


class ParameterAveragingTrainingMaster(TrainingMaster):
    """Synchronous parameter averaging (DL4J's ParameterAveragingTrainingMaster): the workers
    train ``averaging_frequency`` minibatches each, then their parameters are averaged; all
    rounds in one Spark stage for DataFrames and Parquet, one Spark job per round otherwise
    (``one_stage``, below).

    ``averaging_frequency``: minibatches each worker trains per round (default 5; 50 with
    DiLoCo). ``save_updater=True`` (the default) averages and re-broadcasts the optimizer state
    too; False restarts every averaging round from the optimizer's initial state, as DL4J's real
    default does (which resets momentum and Adam's moments every averaging round).
    ``aggregation_depth`` is the ``treeAggregate`` depth. ``job_timeout`` bounds each averaging
    round's job. ``prefetch_batches``: minibatches a task reads ahead, shuffles and holds at
    once (its memory bound). ``drop_last``: leave out each partition's short last minibatch
    per epoch, as a DataLoader's ``drop_last`` does (BatchNorm refuses a minibatch of one row).

    DiLoCo on the cluster (``training_mode="diloco"``'s algorithm) with ``outer_optimizer``
    or ``encoding``: each task sends its pseudo-gradient (round start minus trained
    parameters) encoded with ``encoding`` (a ``TopK``; ``"topk"``, the default, keeps 5% of the
    entries in int8, the rest in the task's residual; ``"dense"`` sends everything), and the
    driver steps the shared parameters with ``outer_optimizer`` (a factory taking the
    parameters, or ``"averaging"``, the default: SGD at lr 1; ``"nesterov"``: the paper's).
    The inner optimizer's state then stays with each partition (``save_updater=True``) or
    restarts every round (False), and is not merged into your optimizer. Raises ``ValueError``
    for an unknown encoding or an outer factory that does not return an optimizer.

    ``one_stage``: where the rounds run. True: every round inside one barrier stage, the tasks
    averaging among themselves with one all-reduce per round (no Spark job per round, no
    driver in the loop; needs ``workers`` task slots at once); False: one Spark job per round
    through the driver (DL4J's design; what DiLoCo uses); None (the default): one stage for
    DataFrames and Parquet paths when the cluster has the slots, per round otherwise (RDDs,
    DiLoCo). A one-stage fit checkpoints right after an averaging to ``checkpoint_dir``
    (default: a temporary folder; give a shared one on a cluster), where a re-run stage
    resumes. ``timeout`` (seconds, default 300) bounds each all-reduce of a one-stage fit: a
    task stuck that long fails its peers' wait, and the stage with them (``job_timeout``
    bounds the whole fit).
    """

    name = "averaging"

    def __init__(self, batch_size_per_worker: int = 32, averaging_frequency: int | None = None,
                 workers: int | None = None, *, save_updater: bool = True,
                 aggregation_depth: int = 2,
                 storage_level: StorageLevel | str | None = "MEMORY_ONLY",
                 repartition: str | None = None, job_timeout: float | None = None,
                 prefetch_batches: int = 16,
                 outer_optimizer: OuterOptimizer | str | None = None,
                 encoding: TopK | str | None = None, one_stage: bool | None = None,
                 checkpoint_dir: str | None = None, timeout: float = 300.0,
                 drop_last: bool = False) -> None:
        super().__init__(batch_size_per_worker, workers, storage_level=storage_level,
                         repartition=repartition, job_timeout=job_timeout,
                         prefetch_batches=prefetch_batches, drop_last=drop_last)
        self.outer_optimizer, self.encoding = resolve_diloco(outer_optimizer, encoding)
        if averaging_frequency is None:
            averaging_frequency = 5 if self.encoding is None else 50
        self.averaging_frequency = positive_int("averaging_frequency", averaging_frequency)
        self.aggregation_depth = positive_int("aggregation_depth", aggregation_depth)
        if not isinstance(save_updater, bool):
            raise TypeError(f"save_updater={save_updater!r}; expected True or False")
        self.save_updater = save_updater
        if one_stage not in (None, True, False):
            raise TypeError(f"one_stage={one_stage!r}; expected None, True or False")
        if one_stage and self.encoding is not None:
            raise ValueError("one_stage=True does not run DiLoCo (outer_optimizer= or "
                             "encoding=): its rounds go through the driver; leave one_stage "
                             "unset")
        self.one_stage = one_stage
        self.checkpoint_dir = checkpoint_dir
        self.timeout = positive_seconds("timeout", timeout)

    def takes_parquet(self, sc: SparkContext) -> bool:
        return self.encoding is None and self.one_stage is not False and \
            self.resolve_workers(sc) <= self.slots(sc)

    def _in_one_stage(self, job: FitJob, rows: RDD[Pair] | ParquetSet) -> bool:
        return isinstance(rows, ParquetSet) or bool(self.one_stage) or \
            (job.columns is not None and self.takes_parquet(job.sc))

    def _fit_in_one_stage(self, job: FitJob, rows: RDD[Pair] | ParquetSet, workers: int,
                          epochs: int, seed: int, collect_stats: bool) -> FitResult:
        self.check_slots(job.sc, workers)
        directory = self.checkpoint_dir or self._local_checkpoint_dir(job.sc.master or "local")
        cfg = SharedConfig(fit_id=job.fit_id, world_size=workers, epochs=epochs,
                           batch_size=self.batch_size_per_worker, seed=seed, origin=time.time(),
                           features=job.features, window_rows=self.window_rows(),
                           checkpoint_dir=directory, collect_stats=collect_stats,
                           timeout_s=self.timeout, drop_last=self.drop_last)
        data = rows if isinstance(rows, ParquetSet) else \
            self.prepare(rows, workers, job, persist=False)
        return fit_in_one_stage(job, data, cfg, self.averaging_frequency, self.save_updater,
                                self.job_timeout)

    def fit(self, job: FitJob, rows: RDD[Pair] | ParquetSet, *, epochs: int, seed: int,
            collect_stats: bool) -> FitResult:
        """Train ``epochs`` passes in averaging rounds; returns the averaged parameters."""
        sc, origin = job.sc, time.time()
        workers = self.resolve_workers(sc)
        if self._in_one_stage(job, rows):
            return self._fit_in_one_stage(job, rows, workers, epochs, seed, collect_stats)
        if isinstance(rows, ParquetSet):
            raise TypeError("a Parquet set trains in one stage only")
        data = self.prepare(rows, workers, job)
        spec_bc = sc.broadcast(pickle_spec(replace(job.spec, synchronizer=NoSync())))
        start = time.perf_counter()
        try:
            sizes, attempts = run_job(sc, data.mapPartitions(_rows).collect,
                                      "paraloom: count the training rows", self.job_timeout)
            per_epoch = -(-batch_count(max(sizes, default=0), self.batch_size_per_worker,
                                       self.drop_last) // self.averaging_frequency)
            if per_epoch == 0:
                raise ValueError("no partition has a full minibatch of rows (drop_last=True)"
                                 if self.drop_last else "the training data is empty: no "
                                 "partition has any rows")
            base = AveragingRound(fit_id=job.fit_id, epoch=0, index=0,
                                  batch_size=self.batch_size_per_worker,
                                  frequency=self.averaging_frequency, seed=seed, origin=origin,
                                  features=job.features, save_updater=self.save_updater,
                                  collect_stats=collect_stats, window_rows=self.window_rows(),
                                  encoding=self.encoding, drop_last=self.drop_last)
            driver = _Driver(self, job, data, spec_bc, base)
            for epoch in range(epochs):
                for index in range(per_epoch):
                    attempts = max(attempts, driver.run(epoch, index, epoch * per_epoch + index))
        finally:
            if self.encoding is not None:
                _forget_local(job, data)
            spec_bc.unpersist()
            data.unpersist()
        seconds = time.perf_counter() - start
        summary = averaging_summary(driver.totals, job.spec.model, driver.base, workers, epochs,
                                    seconds, attempts, sizes,
                                    None if self.outer_optimizer is None
                                    else describe_factory(self.outer_optimizer))
        stats = None
        if collect_stats:
            stats = TrainingStats("ParameterAveragingTrainingMaster",
                                  TrainingStats.merge_rounds(driver.task_stats),
                                  driver.events, summary)
        return FitResult(driver.state, driver.optimizer_state, summary, stats)


def _forget_local(job: FitJob, data: RDD[Chunk]) -> None:
    """Delete DiLoCo's per-partition files where the partitions ran (best effort: a file left
    behind is in the temporary directory, in a folder named after the fit). It runs while a
    failed fit's error is on its way, so it never raises (a stopped SparkContext included)."""
    fit_id = job.fit_id
    try:
        run_job(job.sc, lambda: data.foreachPartition(lambda _: remove_local(fit_id)),
                "paraloom: DiLoCo's local files", 60.0)
    except Exception:  # noqa: BLE001 - cleanup must not hide the fit's own error
        pass


class _Driver:
    """The driver's side between averaging rounds: the current parameters, and what each
    averaging round recorded."""

    def __init__(self, master: ParameterAveragingTrainingMaster, job: FitJob, data: RDD[Chunk],
                 spec_bc: Broadcast[bytes], base: AveragingRound) -> None:
        self.master, self.job, self.data, self.spec_bc, self.base = master, job, data, spec_bc, base
        self.state = job.state
        self.optimizer_state = job.optimizer_state
        self.outer = None if master.outer_optimizer is None else \
            OuterStep(job.state, trainable_names(job.spec.model), master.outer_optimizer)
        self.flat: np.ndarray | None = None
        """DiLoCo: the last round's shared state, flat (its sparse update's starting point)."""
        self.totals: list[AveragingRoundTotals] = []
        self.task_stats: list[WorkerStats] = []
        self.events: list[Event] = []

    def _event(self, name: str, began: float) -> None:
        self.events.append(Event(name=name, start=began - self.base.origin,
                                 duration=time.time() - began))

    def run(self, epoch: int, index: int, sequence: int) -> int:
        """Run averaging round ``index`` of ``epoch`` (the fit's ``sequence``-th); returns the
        stage attempts it took."""
        sc, master = self.job.sc, self.master
        began = time.time()
        # DiLoCo: the inner optimizer's state stays with the partitions.
        optimizer = self.optimizer_state if master.save_updater and self.outer is None else None
        full = pack(self.state, optimizer)
        state_bc = sc.broadcast(full)
        update_bc = None
        if self.outer is not None:
            update, self.flat = state_update(self.flat, self.state, len(full), sequence)
            update_bc = None if update is None else sc.broadcast(update)
        self._event(f"broadcast {epoch}.{index}", began)
        cfg = replace(self.base, epoch=epoch, index=index, sequence=sequence, update=update_bc)
        job = self.data.mapPartitionsWithIndex(partial(averaging_task, self.spec_bc, state_bc, cfg))
        began = time.time()
        try:
            total, attempts = run_job(
                sc, lambda: job.treeAggregate(None, add_results, add_results,
                                              depth=master.aggregation_depth),
                f"paraloom ParameterAveragingTrainingMaster round {epoch}.{index}",
                master.job_timeout)
        finally:
            state_bc.unpersist()
            if update_bc is not None:
                update_bc.unpersist()
        self._event(f"round {epoch}.{index}", began)
        began = time.time()
        self._average(total, epoch)
        self._event(f"average {epoch}.{index}", began)
        return attempts

    def _average(self, total: AveragingSums | None, epoch: int) -> None:
        """Keep the averaging round's counts and stats; adopt the averaged parameters."""
        if total is None:
            return
        total = weighted(total)
        self.task_stats.extend(total.stats)
        n = total.n
        self.totals.append(AveragingRoundTotals(
            epoch, n, total.loss_sum, total.steps, total.bytes_received, total.bytes_sent,
            total.peak_rss))
        if not n or total.model is None or total.layout is None:
            return
        if self.outer is not None:  # DiLoCo: the buffers averaged, the anchor stepped
            if total.pseudo is None:
                raise ValueError("a DiLoCo round returned no pseudo-gradient")
            state = {**self.state, **unflatten(total.model / n, total.layout)}
            self.state = self.outer.step(state, total.pseudo / n)
            return
        # A module's extra state that is not a tensor is not averaged: the driver's stays.
        self.state = {**self.state, **unflatten(total.model / n, total.layout)}
        if total.optimizer is not None and total.optimizer_layout is not None \
                and total.skeleton is not None:
            tensors = unflatten(total.optimizer / n, total.optimizer_layout)
            self.optimizer_state = join_optimizer_state(tensors, total.skeleton)
