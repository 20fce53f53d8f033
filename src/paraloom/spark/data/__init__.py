"""Training data on Spark: rows and DataFrames to numpy arrays, deterministic partitions."""

from paraloom.spark.data.rows import (
    Features,
    as_rows,
    batch_count,
    epoch_order,
    join_chunks,
    partition_arrays,
    partition_chunks,
    round_batches,
    to_array,
)

__all__ = ["Features", "as_rows", "batch_count", "epoch_order", "join_chunks",
           "partition_arrays", "partition_chunks", "round_batches", "to_array"]
