"""What training and evaluation share on the executors: state as bytes, the per-worker cache."""

from paraloom.spark.runtime.executor import cached, gpu_addresses, peak_rss, task_threads
from paraloom.spark.runtime.state import (
    Packed,
    flatten,
    join_optimizer_state,
    pack,
    split_optimizer_state,
    state_digest,
    unflatten,
    unpack,
)

__all__ = ["Packed", "cached", "flatten", "gpu_addresses", "join_optimizer_state", "pack",
           "peak_rss", "split_optimizer_state", "state_digest", "task_threads", "unflatten",
           "unpack"]
