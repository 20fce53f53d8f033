"""The TrainingMaster base class: the options both training masters have, validated at
construction, and how they lay the training rows out over the workers."""

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING, Literal, overload

from paraloom._warnings import warn
from paraloom.spark.data import Chunk, Pair, partition_chunks
from paraloom.spark.data.parquet import ParquetSet
from paraloom.spark.data.partitions import spread_chunks
from paraloom.spark.training.jobs import FitJob, FitResult

if TYPE_CHECKING:
    from pyspark import RDD, SparkContext, StorageLevel

__all__ = ["TrainingMaster", "storage_level_of", "REPARTITION", "positive_int",
           "positive_seconds"]

REPARTITION = ("always", "if_needed", "never")


def storage_level_of(level: StorageLevel | str | None) -> StorageLevel | None:
    """A pyspark StorageLevel from a StorageLevel, its name ("MEMORY_ONLY"), or None."""
    if level is None:
        return None
    from pyspark import StorageLevel

    if isinstance(level, StorageLevel):
        return level
    named = getattr(StorageLevel, level.upper(), None) if isinstance(level, str) else None
    if isinstance(named, StorageLevel):
        return named
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
    """Base class of DL4J's training masters: the options every master has, validated at
    construction. ``SparkModel.fit`` hands a master a ``FitJob`` and the rows; the master runs
    the Spark jobs and returns a ``FitResult``."""

    name = "master"

    def __init__(self, batch_size_per_worker: int, workers: int | None, *,
                 storage_level: StorageLevel | str | None = "MEMORY_ONLY",
                 repartition: str | None = None,
                 job_timeout: float | None = None, prefetch_batches: int = 16,
                 drop_last: bool = False) -> None:
        self.batch_size_per_worker = positive_int("batch_size_per_worker", batch_size_per_worker)
        if not isinstance(drop_last, bool):
            raise TypeError(f"drop_last={drop_last!r}; expected True or False")
        self.drop_last = drop_last
        self.prefetch_batches = positive_int("prefetch_batches", prefetch_batches)
        self.workers = positive_int("workers", workers, allow_none=True)
        storage_level_of(storage_level)  # a wrong name fails here, not at the first fit()
        self.storage_level = storage_level
        if repartition is not None and repartition not in REPARTITION:
            raise ValueError(f"repartition={repartition!r}; expected None or one of "
                             f"{REPARTITION}")
        self.repartition = repartition
        self.job_timeout = positive_seconds("job_timeout", job_timeout, allow_none=True)
        self._warned_local_checkpoints = False

    def window_rows(self) -> int:
        """Rows a worker reads ahead, shuffles and holds at once: ``prefetch_batches``
        minibatches (DL4J's workerPrefetchNumBatches); memory does not grow with the data."""
        return self.prefetch_batches * self.batch_size_per_worker

    def resolve_workers(self, sc: SparkContext) -> int:
        """``workers``, or every task slot of the cluster (default parallelism / task CPUs)."""
        return self.workers or self.slots(sc)

    def slots(self, sc: SparkContext) -> int:
        """Tasks the cluster runs at once: default parallelism over ``spark.task.cpus``."""
        cpus = int(sc.getConf().get("spark.task.cpus", "1"))
        return max(1, sc.defaultParallelism // max(1, cpus))

    def check_slots(self, sc: SparkContext, workers: int) -> None:
        """A barrier stage runs all its tasks at once: ``workers`` must fit the cluster."""
        slots = self.slots(sc)
        if workers > slots:
            raise ValueError(f"workers={workers} but the cluster has {slots} task slot(s): a "
                             f"barrier stage runs all its tasks at once. Use workers <= "
                             f"{slots} or add executors (dynamic allocation must be off)")

    def _local_checkpoint_dir(self, master_url: str) -> str:
        """The default checkpoint_dir: this machine's temp folder; warns (once) when the
        executors may run on other machines, where a re-run stage could not resume from it."""
        if not master_url.startswith("local") and not self._warned_local_checkpoints:
            self._warned_local_checkpoints = True
            warn(f"{type(self).__name__}: checkpoint_dir is not set, so checkpoints go to each "
                 f"executor's temp folder, but the master is {master_url!r}: a barrier stage "
                 "that Spark re-runs resumes only if every executor can read the checkpoint. "
                 "Set checkpoint_dir= to shared storage (NFS, HDFS mounted, ...)")
        return os.path.join(tempfile.gettempdir(), "paraloom-spark")

    def prepare(self, rows: RDD[Pair], workers: int, job: FitJob,
                persist: bool = True) -> RDD[Chunk]:
        """``job``'s training rows (or chunks) as ``workers`` sorted partitions of chunks,
        persisted at ``storage_level`` when ``persist`` (a stage that reads them once needs no
        copy).

        ``repartition=None`` (the default) keeps a DataFrame's partitions when there are
        ``workers`` of them (no shuffle: Spark's barrier stages cannot merge partitions without
        one), unless they are Spark's bins of Parquet files (``FitJob.from_files``), and
        spreads everything else."""
        dataframe = job.columns is not None and not job.from_files
        mode = self.repartition or ("if_needed" if dataframe else "always")
        data = (spread_chunks(rows, workers, mode) if job.chunked
                else partition_chunks(rows, workers, mode))
        level = storage_level_of(self.storage_level)
        if level is not None and persist:
            data.persist(level)
        return data

    def takes_parquet(self, sc: SparkContext) -> bool:
        """Whether ``fit`` reads a ``ParquetSet`` straight from the files (else
        ``SparkModel.fit_paths`` hands it a DataFrame of them)."""
        return True

    def fit(self, job: FitJob, rows: RDD[Pair] | ParquetSet, *, epochs: int, seed: int,
            collect_stats: bool) -> FitResult:
        """Train ``epochs`` passes over ``rows`` (an RDD of rows or chunks, or a Parquet
        set); returns the final state, the summary and the stats."""
        raise NotImplementedError

    def __repr__(self) -> str:
        keys = [k for k in vars(self) if not k.startswith("_")]
        return f"{type(self).__name__}({', '.join(f'{k}={getattr(self, k)!r}' for k in keys)})"
