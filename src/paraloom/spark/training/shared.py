"""SharedTrainingMaster: threshold-encoded update sharing inside one Spark barrier stage.

The tasks of one barrier stage (``barrier.py``) form a torch.distributed group (gloo on CPU,
NCCL on GPU) and train with the same ``SharedGradients`` synchronizer as ParallelWrapper, every
step, for every epoch of the ``fit()``.
"""

from __future__ import annotations

import copy
import time
from dataclasses import replace
from enum import Enum
from typing import TYPE_CHECKING

from paraloom.spark.data import Pair
from paraloom.spark.data.parquet import ParquetSet
from paraloom.spark.runtime import unpack
from paraloom.spark.training.barrier import StageOutcome, StageRun, run_barrier_stage, stage_outcome
from paraloom.spark.training.base import TrainingMaster, positive_int, positive_seconds
from paraloom.spark.training.jobs import FitJob, FitResult
from paraloom.spark.training.rendezvous import NetworkSettings
from paraloom.spark.training.shared_task import SharedConfig
from paraloom.spark.training.summary import shared_summary
from paraloom.sync.base import Synchronizer
from paraloom.sync.registry import warn_without_idle_step
from paraloom.sync.sharing import SharedGradients, SharingRecipe
from paraloom.sync.thresholds import ResidualClipping, ResidualPostProcessor, ThresholdAlgorithm

if TYPE_CHECKING:
    from pyspark import RDD, StorageLevel

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
    epochs). ``drop_last``: leave out each partition's short last minibatch per epoch, as a
    DataLoader's ``drop_last`` does (BatchNorm refuses a minibatch of one row). ``synchronizer``
    replaces
    SharedGradients by any Synchronizer (e.g. dense all-reduce) for comparisons.
    """

    name = "shared"

    def __init__(self, batch_size_per_worker: int = 32, workers: int | None = None,
                 threshold_algorithm: ThresholdAlgorithm | None = None,
                 residual_post_processor: ResidualPostProcessor | None | _Default = _DEFAULT,
                 *, workers_per_node: int | None = None,
                 storage_level: StorageLevel | str | None = "MEMORY_ONLY",
                 repartition: str | None = None, timeout: float = 300.0,
                 rendezvous_timeout: float = 300.0, job_timeout: float | None = None,
                 checkpoint_dir: str | None = None, checkpoint_every: int = 50,
                 backend: str | None = None, synchronizer: Synchronizer | None = None,
                 recipe: str | SharingRecipe = "dgc", network: NetworkSettings | None = None,
                 prefetch_batches: int = 16, drop_last: bool = False) -> None:
        super().__init__(batch_size_per_worker, workers, storage_level=storage_level,
                         repartition=repartition, job_timeout=job_timeout,
                         prefetch_batches=prefetch_batches, drop_last=drop_last)
        residual_post_processor = _post_processor(residual_post_processor, recipe)
        _check_synchronizer(synchronizer, threshold_algorithm)
        if synchronizer is not None:
            warn_without_idle_step(synchronizer)
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
            drop_last=self.drop_last,
            network=self.network)

    def fit(self, job: FitJob, rows: RDD[Pair] | ParquetSet, *, epochs: int, seed: int,
            collect_stats: bool) -> FitResult:
        """Train in one barrier stage; returns rank 0's final parameters and optimizer state."""
        workers = self.resolve_workers(job.sc)
        self.check_slots(job.sc, workers)
        cfg = self._config(job, workers, epochs, seed, collect_stats)
        job = replace(job, spec=replace(job.spec, synchronizer=copy.deepcopy(self.synchronizer)))
        data = rows if isinstance(rows, ParquetSet) else \
            self.prepare(rows, workers, job, persist=False)
        run = run_barrier_stage(job, data, cfg, "SharedTrainingMaster", self.job_timeout)
        return self._result(job, run, cfg)

    def _result(self, job: FitJob, run: StageRun, cfg: SharedConfig) -> FitResult:
        packed = unpack(run.outcome.state)
        reports = run.outcome.reports
        summary = shared_summary(reports, job.spec.model, cfg, run.seconds, run.attempts)
        stats = run.stats("SharedTrainingMaster", summary) if cfg.collect_stats else None
        return FitResult(packed.model, packed.optimizer, summary, stats)
