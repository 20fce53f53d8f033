"""How a failed barrier task tells its peers why, so each failure ends the right way.

A Python error in one rank (bad data, a loss that raises) is the same on every retry: the fit
should stop with that error, once. A dead rank (killed process, lost executor) is what a retry
fixes. The two look alike to the peers (a collective fails), so the failing rank *posts* its
error on rank 0's store before it leaves the process group; a peer whose collective failed
looks there first:

* a posted error: report it in a ``WorkerFailed`` record (the task succeeds, the stage
  completes, the driver raises it);
* nothing posted: the peer died, so fail this task too, and Spark re-runs the whole stage.

A rank that completes its task while the stage fails anyway must not: Spark would keep its
output and re-run only the dead partitions, a barrier stage with the wrong number of tasks.
"""

from __future__ import annotations

import datetime
import json
import time
import traceback
from dataclasses import dataclass

import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, Store

from paraloom.spark.training.messages import WorkerFailed
from paraloom.spark.training.rendezvous import MEMBERSHIP
from paraloom.spark.training.task import failure
from paraloom.training.failures import is_symptom

__all__ = ["ErrorBoard", "Posted", "leave_group", "settle"]

_POLL_S = 0.05


@dataclass(frozen=True)
class Posted:
    """An error a rank posted on the board."""

    rank: int
    message: str
    traceback: str


class ErrorBoard:
    """Error messages and acknowledgements under this stage attempt's prefix of the store."""

    def __init__(self, store: Store, rank: int, world_size: int, run_id: str) -> None:
        self.store = PrefixStore(f"paraloom/{run_id}/board", store)
        self.rank = rank
        self.world_size = world_size

    def post(self, message: str, tb: str) -> None:
        """Publish this rank's error for its peers."""
        self.store.set(f"error/{self.rank}", json.dumps({"message": message, "traceback": tb}))

    def causes(self, wait_s: float = 2.0) -> list[Posted]:
        """Errors the other ranks posted, waiting up to ``wait_s`` for the first one."""
        deadline = time.monotonic() + wait_s
        while True:
            found = []
            for r in range(self.world_size):
                key = f"error/{r}"
                if r != self.rank and self.store.check([key]):
                    posted = json.loads(self.store.get(key))
                    found.append(Posted(r, str(posted["message"]), str(posted["traceback"])))
            if found or time.monotonic() >= deadline:
                return found
            time.sleep(_POLL_S)

    def ack(self) -> None:
        """Tell rank 0 (which hosts the store) that this rank no longer needs it."""
        self.store.set(f"ack/{self.rank}", "1")

    def wait_acks(self, timeout_s: float) -> None:
        """Rank 0: keep the store up until every peer has read the board (or ``timeout_s``)."""
        keys = [f"ack/{r}" for r in range(1, self.world_size)]
        if keys:
            try:
                self.store.wait(keys, datetime.timedelta(seconds=timeout_s))
            except Exception:  # a peer that died never acknowledges: stop waiting for it
                pass

    def done(self, timeout_s: float) -> None:
        """The end of the error path: acknowledge, or (rank 0) wait for the acknowledgements."""
        if self.rank == 0:
            self.wait_acks(timeout_s)
        else:
            self.ack()


def leave_group() -> None:
    """Leave the process group: this rank's connections close at once, so peers stop waiting
    (``rendezvous.MEMBERSHIP``)."""
    if dist.is_available():
        MEMBERSHIP.leave()


def settle(error: Exception, board: ErrorBoard | None, rank: int,
           linger_s: float = 10.0) -> WorkerFailed:
    """The record of a failed rank: its own error, or the one a peer posted; re-raises the
    error when only a dead peer explains it."""
    message = f"{type(error).__name__}: {error}"
    tb = "".join(traceback.format_exception(error))
    if board is None:
        raise error
    try:
        if not is_symptom(message):  # our own error: post it before the peers see us leave
            board.post(message, tb)
            leave_group()
            board.done(linger_s)
            return failure(rank, error)
        leave_group()
        causes = board.causes()
    except Exception:  # the store is gone with rank 0: treat as a dead peer
        raise error from None
    if not causes:
        raise error  # a peer died: fail this task too so that Spark re-runs the whole stage
    cause = causes[0]
    board.done(linger_s)
    return failure(rank, cause.message, cause.traceback, cause_rank=cause.rank)
