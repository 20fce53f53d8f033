"""What a DataFrame's plan tells before any job: whether it is Parquet files read as they are
(``fit(df)`` trains those from the files), and whether its partitions are many and small
(``compacted`` merges them before a fit or an evaluation).

A DataFrame made by ``spark.read.parquet(...)``, with at most a choice of its columns on top
(``select`` of plain columns, ``alias``, ``cache``), holds exactly the files' rows, so a training
task can read its share of the files itself (``fit_paths``' path: no shuffle, and the first step
as soon as its rows are decoded) instead of receiving a partition through Spark. Anything else
(a filter, a join, a computed or renamed column, a Delta or Iceberg table, a Spark Connect
DataFrame) is left to the DataFrame path, since the files alone would not give its rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

__all__ = ["PARTITION_BYTES", "compacted", "parquet_files"]

_PASS_THROUGH = ("SubqueryAlias", "ResolvedHint")

D = TypeVar("D")

PARTITION_BYTES = 64 << 20
"""The most ``compacted`` puts in one partition, by Spark's size estimate: adaptive query
execution's ``spark.sql.adaptive.advisoryPartitionSizeInBytes`` default."""


def _class(node: Any) -> str:
    return str(node.getClass().getSimpleName())


def _seq(seq: Any) -> list[Any]:
    """A Scala ``Seq`` from the JVM as a Python list."""
    return [seq.apply(i) for i in range(seq.size())]


def _plain_projection(node: Any) -> bool:
    """A ``Project`` that only picks columns (no expression, no rename)."""
    return all(_class(e) == "AttributeReference" for e in _seq(node.projectList()))


def _relation(df: DataFrame) -> Any | None:
    """The ``HadoopFsRelation`` under a DataFrame that only picks its columns, else None."""
    plan = df._jdf.queryExecution().analyzed()
    while True:
        name = _class(plan)
        if name == "Project" and _plain_projection(plan) or name in _PASS_THROUGH:
            plan = plan.child()
        elif name == "LogicalRelation":
            relation = plan.relation()
            return relation if _class(relation) == "HadoopFsRelation" else None
        else:
            return None


def parquet_files(df: DataFrame, names: Sequence[str]) -> list[str] | None:
    """The Parquet files ``df`` reads, sorted by path (as ``fit_paths`` lists a folder), where
    ``df`` is those files' rows as they are and ``names`` are all columns of the files
    themselves (not a partition directory's); else None.

    Never raises: a plan it cannot read (another Spark version, Spark Connect) is None.
    """
    try:
        relation = _relation(df)
        if relation is None or _class(relation.fileFormat()) != "ParquetFileFormat":
            return None
        stored = set(relation.dataSchema().fieldNames())
        partitioned = set(relation.partitionSchema().fieldNames())
        if not set(names) <= stored - partitioned:
            return None
        files = sorted(str(f) for f in relation.location().inputFiles())  # as a folder lists
    except Exception:  # py4j errors, a missing _jdf: the DataFrame path is always right
        return None
    return files or None


def compacted(data: D, partition_bytes: int = PARTITION_BYTES) -> D:
    """``data`` with its partitions merged (``coalesce``: no shuffle, each row read once)
    where a DataFrame has more than twice as many as the cluster has cores, and Spark's
    estimate of its size needs fewer at ``partition_bytes`` each (at least twice the cores).

    Each partition is a Python task, which costs Spark 50-100 ms of a core whatever its rows;
    300 rows in 200 partitions (``repartition(200)``, or ``spark.sql.shuffle.partitions``
    where adaptive execution is off) took 30 s to fit or evaluate on two cores, 2 s merged.
    An RDD, a DataFrame of unknown size (a Hive table without statistics, one made from an
    RDD), one whose plan does not give its partition count (a local table, Parquet's file
    bins) or one whose plan cannot be read is returned as it is. Runs no Spark job.
    """
    frame: Any = data
    try:
        if not hasattr(frame, "_jdf"):  # an RDD, or a Spark Connect DataFrame
            return data
        # From the physical plan, before adaptive execution: df.rdd.getNumPartitions() would
        # run the plan's shuffles (a job), and the fit or evaluation would run them again.
        # 0 where the plan does not say (a local table, Parquet's file bins): kept.
        execution = frame._jdf.queryExecution()
        have = int(execution.sparkPlan().outputPartitioning().numPartitions())
        floor = 2 * int(frame.sparkSession.sparkContext.defaultParallelism)
        size = int(str(execution.optimizedPlan().stats().sizeInBytes()))
    except Exception:  # py4j errors: merging is only ever a saving
        return data
    want = max(floor, -(-size // partition_bytes))
    return cast(D, frame.coalesce(want)) if want < have else data
