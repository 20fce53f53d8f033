"""Which DataFrames are Parquet files read as they are: ``fit(df)`` trains those from the files.

A DataFrame made by ``spark.read.parquet(...)``, with at most a choice of its columns on top
(``select`` of plain columns, ``alias``, ``cache``), holds exactly the files' rows, so a training
task can read its share of the files itself (``fit_paths``' path: no shuffle, and the first step
as soon as its rows are decoded) instead of receiving a partition through Spark. Anything else
(a filter, a join, a computed or renamed column, a Delta or Iceberg table, a Spark Connect
DataFrame) is left to the DataFrame path, since the files alone would not give its rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

__all__ = ["parquet_files"]

_PASS_THROUGH = ("SubqueryAlias", "ResolvedHint")


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
