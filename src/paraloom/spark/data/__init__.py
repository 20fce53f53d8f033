"""Training data on Spark: rows and DataFrames to numpy arrays, deterministic partitions."""

from paraloom.spark.data.arrays import Arrays, num_rows, take
from paraloom.spark.data.batches import batch_count
from paraloom.spark.data.features import Features, Tensors
from paraloom.spark.data.partitions import Chunk, join_chunks, partition_chunks
from paraloom.spark.data.rows import (
    Columns,
    FieldSpec,
    Inputs,
    Label,
    Pair,
    Spec,
    as_rows,
    check_columns,
    is_dataframe,
    is_rdd,
    partition_arrays,
    row_extractor,
    rows_of,
    to_array,
)

__all__ = ["Arrays", "Chunk", "Columns", "Features", "FieldSpec", "Inputs", "Label", "Pair", "Spec",
           "Tensors", "as_rows", "batch_count", "check_columns", "is_dataframe", "is_rdd",
           "join_chunks", "num_rows", "partition_arrays", "partition_chunks", "row_extractor",
           "rows_of", "take", "to_array"]
