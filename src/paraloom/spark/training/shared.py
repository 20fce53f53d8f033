"""SharedTrainingMaster: threshold-encoded update sharing inside one Spark barrier stage.

One barrier task per worker runs ``shared_task``: the tasks meet once through
``BarrierTaskContext.allGather``, form a torch.distributed group (gloo on CPU, NCCL on GPU) and
train with the same ``SharedGradients`` synchronizer as ParallelWrapper, every step, for every
epoch of the ``fit()``. A shuffle after the stage makes it a ShuffleMapStage, which Spark
re-runs as a whole when a task dies (a barrier ResultStage is never retried); the re-run
resumes from rank 0's last checkpoint.
"""

from __future__ import annotations

import copy
import os
import tempfile
import time
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from enum import Enum
from typing import TYPE_CHECKING

from paraloom.spark.data import Chunk, Pair
from paraloom.spark.runtime import pack, unpack
from paraloom.spark.stats import Event, TrainingStats
from paraloom.spark.training.base import TrainingMaster, positive_int, positive_seconds
from paraloom.spark.training.jobs import FitJob, FitResult, SparkTrainingError, run_job
from paraloom.spark.training.messages import (
    TaskRecord,
    WorkerFailed,
    WorkerFinished,
    WorkerReport,
    WorkerRerun,
)
from paraloom.spark.training.rendezvous import NetworkSettings
from paraloom.spark.training.shared_task import SharedConfig, checkpoint_path, shared_task
from paraloom.spark.training.summary import shared_summary
from paraloom.spark.training.task import pickle_spec
from paraloom.sync.base import Synchronizer
from paraloom.sync.sharing import SharedGradients, SharingRecipe
from paraloom.sync.thresholds import ResidualClipping, ResidualPostProcessor, ThresholdAlgorithm

if TYPE_CHECKING:
    from pyspark import RDD, SparkContext, StorageLevel

__all__ = ["SharedTrainingMaster", "StageOutcome", "stage_outcome"]


class _Default(Enum):
    """The type of ``_DEFAULT``: "not given", where None means "none"."""

    DEFAULT = "default"


_DEFAULT = _Default.DEFAULT


def _post_processor(given: ResidualPostProcessor | None | _Default,
                    recipe: str | SharingRecipe) -> ResidualPostProcessor | None:
    """``residual_post_processor`` as SharedGradients takes it: not given, the recipe's (None
    lets SharedGradients choose; the "dl4j" preset's by name is Spark DL4J's clipping); None,
    the no-op base class."""
    if given is _DEFAULT:
        return ResidualClipping(5.0, 5) if recipe == "dl4j" else None
    if given is None:
        return ResidualPostProcessor()  # none: the no-op base class
    return given


def _check_synchronizer(synchronizer: object, threshold_algorithm: object) -> None:
    """A synchronizer given instead of SharedGradients: a Synchronizer, without a threshold."""
    if synchronizer is None:
        return
    if not isinstance(synchronizer, Synchronizer):
        raise TypeError(f"synchronizer={synchronizer!r}; expected a paraloom "
                        f"Synchronizer instance")
    if threshold_algorithm is not None:
        raise TypeError("threshold_algorithm applies to the default SharedGradients "
                        "synchronizer only; configure your synchronizer directly")


class SharedTrainingMaster(TrainingMaster):
    """DL4J's gradient-sharing master: every worker shares its threshold-encoded updates.

    ``recipe`` is SharedGradients' (see ``paraloom.sync.sharing``): a ``SharingRecipe``, taken
    as it is, or a preset's name: "dgc" (the default: top ~1/160 of the residual per message
    in gap16 messages, gradients at the local view, ``ResidualClipping(2.0, 1)``; it trains at
    the dense recipe's learning rate) or "dl4j" (``AdaptiveThreshold()``,
    ``ResidualClipping(5.0, 5)``, each worker's update applied in full: DL4J's Spark
    defaults). With a preset's name, ``threshold_algorithm`` and ``residual_post_processor``
    override the preset's (``residual_post_processor=None`` for none).
    ``workers`` defaults to the cluster's task slots; each worker is one barrier task and
    trains ``batch_size_per_worker`` rows per step. ``workers_per_node`` sets each task's
    torch threads to the node's cores divided by it (default: ``spark.task.cpus``).
    ``timeout`` bounds every collective, ``rendezvous_timeout`` the one barrier allGather,
    ``job_timeout`` (default none) the whole fit. Rank 0 checkpoints every
    ``checkpoint_every`` rounds and at each epoch's end to ``checkpoint_dir`` (default: a
    temporary folder; give a shared one on a cluster). ``network``: a NetworkSettings
    (rendezvous port range, announced host, interface for the collectives; DL4J's
    VoidConfiguration). ``prefetch_batches``: minibatches a task reads ahead, shuffles and
    holds at once (its memory bound; the partition itself waits on local disk between
    epochs). ``synchronizer`` replaces
    SharedGradients by any Synchronizer (e.g. dense all-reduce) for comparisons.
    """

    name = "shared"

    def __init__(self, batch_size_per_worker: int = 32, workers: int | None = None,
                 threshold_algorithm: ThresholdAlgorithm | None = None,
                 residual_post_processor: ResidualPostProcessor | None | _Default = _DEFAULT,
                 *, workers_per_node: int | None = None,
                 storage_level: StorageLevel | str | None = "MEMORY_ONLY",
                 repartition: str = "always", timeout: float = 300.0,
                 rendezvous_timeout: float = 300.0, job_timeout: float | None = None,
                 checkpoint_dir: str | None = None, checkpoint_every: int = 50,
                 backend: str | None = None, synchronizer: Synchronizer | None = None,
                 recipe: str | SharingRecipe = "dgc", network: NetworkSettings | None = None,
                 prefetch_batches: int = 16) -> None:
        super().__init__(batch_size_per_worker, workers, storage_level=storage_level,
                         repartition=repartition, job_timeout=job_timeout,
                         prefetch_batches=prefetch_batches)
        residual_post_processor = _post_processor(residual_post_processor, recipe)
        _check_synchronizer(synchronizer, threshold_algorithm)
        self.threshold_algorithm = threshold_algorithm
        self.residual_post_processor = residual_post_processor
        # Built now so that a wrong threshold or post-processor fails here, not in a task.
        self.synchronizer = synchronizer or SharedGradients(
            threshold_algorithm, residual_post_processor, recipe=recipe)
        self.workers_per_node = positive_int("workers_per_node", workers_per_node,
                                              allow_none=True)
        self.timeout = positive_seconds("timeout", timeout)
        self.rendezvous_timeout = positive_seconds("rendezvous_timeout", rendezvous_timeout)
        self.checkpoint_dir = checkpoint_dir
        self._warned_local_checkpoints = False
        self.checkpoint_every = positive_int("checkpoint_every", checkpoint_every)
        if backend not in (None, "gloo", "nccl", "mpi"):
            raise ValueError(f"backend={backend!r}; expected None (gloo on CPU, NCCL on GPU), "
                             f"'gloo', 'nccl' or 'mpi'")
        self.backend = backend
        if network is not None and not isinstance(network, NetworkSettings):
            raise TypeError(f"network={network!r}; expected a NetworkSettings(port_range=, "
                            f"host=, interface=)")
        self.network = network

    def _check_slots(self, sc: SparkContext, workers: int) -> None:
        cpus = int(sc.getConf().get("spark.task.cpus", "1"))
        slots = max(1, sc.defaultParallelism // max(1, cpus))
        if workers > slots:
            raise ValueError(f"workers={workers} but the cluster has {slots} task slot(s): a "
                             f"barrier stage runs all its tasks at once. Use workers <= "
                             f"{slots} or add executors (dynamic allocation must be off)")

    def _config(self, job: FitJob, workers: int, epochs: int, seed: int,
                collect_stats: bool) -> SharedConfig:
        directory = self.checkpoint_dir or self._local_checkpoint_dir(job.sc.master or "local")
        return SharedConfig(
            fit_id=job.fit_id, world_size=workers, epochs=epochs,
            batch_size=self.batch_size_per_worker, seed=seed, origin=time.time(),
            features=job.features, timeout_s=self.timeout, window_rows=self.window_rows(),
            rendezvous_timeout_s=self.rendezvous_timeout, backend=self.backend,
            workers_per_node=self.workers_per_node, checkpoint_dir=directory,
            checkpoint_every=self.checkpoint_every, collect_stats=collect_stats,
            network=self.network)

    def _local_checkpoint_dir(self, master_url: str) -> str:
        """The default checkpoint_dir: this machine's temp folder; warns (once) when the
        executors may run on other machines, where a re-run stage could not resume from it."""
        if not master_url.startswith("local") and not self._warned_local_checkpoints:
            self._warned_local_checkpoints = True
            warnings.warn(
                f"SharedTrainingMaster: checkpoint_dir is not set, so checkpoints go to each "
                f"executor's temp folder, but the master is {master_url!r}: a barrier stage "
                "that Spark re-runs resumes only if every executor can read the checkpoint. "
                "Set checkpoint_dir= to shared storage (NFS, HDFS mounted, ...)", stacklevel=4)
        return os.path.join(tempfile.gettempdir(), "paraloom-spark")

    def fit(self, job: FitJob, rows: RDD[Pair], *, epochs: int, seed: int,
            collect_stats: bool) -> FitResult:
        """Train in one barrier stage; returns rank 0's final parameters and optimizer state."""
        from pyspark import BarrierTaskContext

        sc = job.sc
        workers = self.resolve_workers(sc)
        self._check_slots(sc, workers)
        cfg = self._config(job, workers, epochs, seed, collect_stats)
        spec = replace(job.spec, synchronizer=copy.deepcopy(self.synchronizer))
        spec_bc = sc.broadcast(pickle_spec(spec))
        state_bc = sc.broadcast(pack(job.state, job.optimizer_state))
        data = self.prepare(rows, workers, job.chunked)

        def run(chunks: Iterable[Chunk]) -> Iterator[TaskRecord]:
            return shared_task(spec_bc.value, state_bc.value, cfg, BarrierTaskContext.get(),
                               chunks)

        # The shuffle after the barrier stage is what lets Spark re-run it when a task dies.
        stage = data.barrier().mapPartitions(run).map(lambda r: (r.rank, r)).partitionBy(1)
        start, launched = time.perf_counter(), time.time() - cfg.origin
        try:
            records, attempts = run_job(sc, stage.values().collect,
                                        f"paraloom SharedTrainingMaster.fit ({workers} workers, "
                                        f"{epochs} epochs)", self.job_timeout)
        finally:
            for handle in (spec_bc, state_bc):
                handle.unpersist()
            data.unpersist()
            checkpoint_path(cfg.checkpoint_dir or "", job.fit_id).unlink(missing_ok=True)
        return self._result(job, records, attempts, (launched, time.perf_counter() - start), cfg)

    def _result(self, job: FitJob, records: list[TaskRecord], attempts: int,
                timing: tuple[float, float], cfg: SharedConfig) -> FitResult:
        launched, seconds = timing
        outcome = stage_outcome(records, cfg.world_size, attempts)
        packed = unpack(outcome.state)
        reports = outcome.reports
        summary = shared_summary(reports, job.spec.model, cfg, seconds, attempts)
        stats = None
        if cfg.collect_stats:
            per_worker = [timings for r in sorted(reports) if (timings := reports[r].stats)]
            stats = TrainingStats("SharedTrainingMaster", per_worker,
                                  [Event(name="barrier stage", start=launched,
                                         duration=seconds)], summary)
        return FitResult(packed.model, packed.optimizer, summary, stats)


@dataclass(frozen=True)
class StageOutcome:
    """What a barrier stage that trained to the end produced."""

    reports: dict[int, WorkerReport]
    """Every worker's report by rank (a worker re-run alone after the fit sends none)."""
    state: bytes
    """Rank 0's final parameters and optimizer state, ``pack``ed."""


def stage_outcome(records: Iterable[TaskRecord], world_size: int,
                  attempts: int) -> StageOutcome:
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
        raise _training_error(failures, attempts)
    if sorted([*reports, *reran]) != list(range(world_size)) or not state:
        raise SparkTrainingError(f"SharedTrainingMaster: expected reports from workers "
                                 f"0..{world_size - 1}, got {sorted(reports)}; the "
                                 f"stage lost results, run fit() again", attempts=attempts)
    return StageOutcome(reports, state)


def _training_error(failures: list[WorkerFailed], attempts: int) -> SparkTrainingError:
    """The error to raise: a rank's own failure first, else one that a peer relayed."""
    first = min(failures, key=lambda f: (f.symptom, f.cause_rank is None, f.rank))
    worker = first.rank if first.cause_rank is None else first.cause_rank
    return SparkTrainingError(f"SharedTrainingMaster: worker {worker} failed: {first.message}",
                              worker=worker, remote_traceback=first.traceback,
                              attempts=attempts)
