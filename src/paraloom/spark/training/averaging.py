"""ParameterAveragingTrainingMaster: one ordinary Spark job per averaging round (DL4J's design).

Each round broadcasts the parameters (and the optimizer state with ``save_updater=True``),
every partition trains ``averaging_frequency`` minibatches of ``batch_size_per_worker`` rows
from where the previous round stopped, and the driver averages what the tasks return with
``treeAggregate``, weighted by the examples each trained. No barrier, no collectives: a
failed task is simply retried by Spark.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any

from paraloom.spark.data import Chunk, Pair, batch_count, num_rows
from paraloom.spark.runtime import join_optimizer_state, pack, unflatten
from paraloom.spark.stats import TrainingStats
from paraloom.spark.training.averaging_task import (
    RoundConfig,
    add_results,
    averaging_task,
    weighted,
)
from paraloom.spark.training.master import FitJob, FitResult, TrainingMaster, positive_int, run_job
from paraloom.spark.training.summary import averaging_summary
from paraloom.spark.training.task import pickle_spec
from paraloom.sync.base import NoSync

if TYPE_CHECKING:
    from pyspark import RDD, Broadcast, StorageLevel

__all__ = ["ParameterAveragingTrainingMaster"]


def _rows(chunks: Iterable[Chunk]) -> list[int]:
    return [sum(num_rows(x) for x, _ in chunks)]  # one chunk at a time


class ParameterAveragingTrainingMaster(TrainingMaster):
    """Synchronous parameter averaging through the driver, one Spark job per round.

    ``save_updater=True`` (the default) averages and re-broadcasts the optimizer state too;
    False restarts every round from the optimizer's initial state, as DL4J's real default
    does (which resets momentum and Adam's moments every round). ``aggregation_depth`` is the
    ``treeAggregate`` depth. ``job_timeout`` bounds each round's job. ``prefetch_batches``:
    minibatches a task reads ahead, shuffles and holds at once (its memory bound).
    """

    name = "averaging"

    def __init__(self, batch_size_per_worker: int = 32, averaging_frequency: int = 5,
                 workers: int | None = None, *, save_updater: bool = True,
                 aggregation_depth: int = 2,
                 storage_level: StorageLevel | str | None = "MEMORY_ONLY",
                 repartition: str = "always", job_timeout: float | None = None,
                 prefetch_batches: int = 16) -> None:
        super().__init__(batch_size_per_worker, workers, storage_level=storage_level,
                         repartition=repartition, job_timeout=job_timeout,
                         prefetch_batches=prefetch_batches)
        self.averaging_frequency = positive_int("averaging_frequency", averaging_frequency)
        self.aggregation_depth = positive_int("aggregation_depth", aggregation_depth)
        if not isinstance(save_updater, bool):
            raise TypeError(f"save_updater={save_updater!r}; expected True or False")
        self.save_updater = save_updater

    def fit(self, job: FitJob, rows: RDD[Pair], *, epochs: int, seed: int,
            collect_stats: bool) -> FitResult:
        """Train ``epochs`` passes in rounds; returns the averaged parameters."""
        sc, origin = job.sc, time.time()
        workers = self.resolve_workers(sc)
        data = self.prepare(rows, workers, job.chunked)
        spec_bc = sc.broadcast(pickle_spec(replace(job.spec, synchronizer=NoSync())))
        start = time.perf_counter()
        try:
            sizes, attempts = run_job(sc, data.mapPartitions(_rows).collect,
                                      "paraloom: count the training rows", self.job_timeout)
            per_epoch = -(-batch_count(max(sizes, default=0), self.batch_size_per_worker)
                          // self.averaging_frequency)
            if per_epoch == 0:
                raise ValueError("the training data is empty: no partition has any rows")
            base = RoundConfig(fit_id=job.fit_id, epoch=0, round=0,
                               batch_size=self.batch_size_per_worker,
                               frequency=self.averaging_frequency, seed=seed, origin=origin,
                               features=job.features, save_updater=self.save_updater,
                               collect_stats=collect_stats, window_rows=self.window_rows())
            loop = _Loop(self, job, data, spec_bc, base)
            for epoch in range(epochs):
                for r in range(per_epoch):
                    attempts = max(attempts, loop.round(epoch, r))
        finally:
            spec_bc.unpersist()
            data.unpersist()
        seconds = time.perf_counter() - start
        summary = averaging_summary(loop.rounds, job, loop.base, workers, epochs, seconds,
                                    attempts)
        summary["rows_per_worker"] = sizes
        stats = None
        if collect_stats:
            stats = TrainingStats("ParameterAveragingTrainingMaster",
                                  TrainingStats.merge_rounds(loop.task_stats),
                                  loop.driver_events, summary)
        return FitResult(loop.state, loop.optimizer_state, summary, stats)


class _Loop:
    """The driver's state between rounds: the current parameters and what was recorded."""

    def __init__(self, master: ParameterAveragingTrainingMaster, job: FitJob, data: RDD[Chunk],
                 spec_bc: Broadcast[bytes], base: RoundConfig) -> None:
        self.master, self.job, self.data, self.spec_bc, self.base = master, job, data, spec_bc, base
        self.state = job.state
        self.optimizer_state = job.optimizer_state
        self.rounds: list[dict[str, Any]] = []
        self.task_stats: list[dict[str, Any]] = []
        self.driver_events: list[dict[str, Any]] = []

    def _event(self, name: str, began: float) -> None:
        self.driver_events.append({"name": name, "start": began - self.base.origin,
                                   "duration": time.time() - began})

    def round(self, epoch: int, r: int) -> int:
        """Run round ``r`` of ``epoch``; returns the stage attempts it took."""
        sc, master = self.job.sc, self.master
        began = time.time()
        optimizer = self.optimizer_state if master.save_updater else None
        state_bc = sc.broadcast(pack(self.state, optimizer))
        self._event(f"broadcast {epoch}.{r}", began)
        cfg = replace(self.base, epoch=epoch, round=r)
        job = self.data.mapPartitionsWithIndex(partial(averaging_task, self.spec_bc, state_bc, cfg))
        began = time.time()
        try:
            total, attempts = run_job(
                sc, lambda: job.treeAggregate(None, add_results, add_results,
                                              depth=master.aggregation_depth),
                f"paraloom ParameterAveragingTrainingMaster round {epoch}.{r}",
                master.job_timeout)
        finally:
            state_bc.unpersist()
        self._event(f"round {epoch}.{r}", began)
        began = time.time()
        self._average(total, epoch)
        self._event(f"average {epoch}.{r}", began)
        return attempts

    def _average(self, total: dict[str, Any] | None, epoch: int) -> None:
        if total is None:
            return
        total = weighted(total)
        self.task_stats.extend(total.get("stats", []))
        n = total["n"]
        self.rounds.append({"epoch": epoch, **{k: total.get(k, 0) for k in
                                                ("n", "loss_sum", "steps", "bytes_received",
                                                 "bytes_sent", "peak_rss")}})
        if not n:
            return
        self.state = unflatten(total["model"] / n, total["layout"])
        if "optimizer" in total:
            tensors = unflatten(total["optimizer"] / n, total["optimizer_layout"])
            self.optimizer_state = join_optimizer_state(tensors, total["skeleton"])
