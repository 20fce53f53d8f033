"""Training data on Spark: rows and DataFrames to numpy arrays, deterministic partitions."""

from paraloom.spark.data.batches import batch_count, epoch_order, round_batches
from paraloom.spark.data.features import Features
from paraloom.spark.data.partitions import Chunk, join_chunks, partition_chunks
from paraloom.spark.data.rows import (
    Pair,
    as_rows,
    is_dataframe,
    is_rdd,
    partition_arrays,
    to_array,
)

__all__ = ["Chunk", "Features", "Pair", "as_rows", "batch_count", "epoch_order", "is_dataframe",
           "is_rdd", "join_chunks", "partition_arrays", "partition_chunks", "round_batches",
           "to_array"]
