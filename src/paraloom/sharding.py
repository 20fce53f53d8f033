"""Sharding data over the replicas: ``replica_info()`` says which replica this code runs in.

An ``IterableDataset`` that every replica iterates reads its own share with it; the replica
sets it in its process (``set_replica_info``) and in its DataLoader workers (``WorkerInit``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["ReplicaInfo", "replica_info"]


@dataclass(frozen=True)
class ReplicaInfo:
    """The replica a dataset is being read for: ``rank`` of ``world_size`` replicas."""

    rank: int
    world_size: int


_current: ReplicaInfo | None = None


def replica_info() -> ReplicaInfo | None:
    """The replica this code runs for, or None outside ParallelWrapper's training.

    Like ``torch.utils.data.get_worker_info()`` (which names the loader worker within a
    replica), it is set in the replica's process and in its DataLoader worker processes, so an
    ``IterableDataset.__iter__`` can read its share of the stream.
    """
    return _current


def set_replica_info(info: ReplicaInfo | None) -> None:
    """Set (or clear) what ``replica_info()`` returns in this process."""
    global _current
    _current = info


@dataclass(frozen=True)
class WorkerInit:
    """A DataLoader ``worker_init_fn`` that sets ``replica_info()`` in a loader worker (one
    started by spawn or forkserver does not inherit it), then calls the user's function."""

    info: ReplicaInfo
    user_fn: Callable[[int], object] | None = None

    def __call__(self, worker_id: int) -> None:
        set_replica_info(self.info)
        if self.user_fn is not None:
            self.user_fn(worker_id)
