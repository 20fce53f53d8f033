"""Forming a pool's process group again after a failure, keeping the survivors' processes.

With gloo, a collective whose peer's process dies ends in an error at once (its sockets
close), and a worker that leaves its group shuts its connections down (``training.group``):
so once the failed worker is killed, every survivor's collective ends, a survivor waiting on
another survivor's part included. Each survivor reports the error, leaves its group and drops
what is queued for it; the pool gives the failed rank to a spare process (started ahead, its
setup unpickled), sends every worker a ``Regroup`` behind what it had queued, and waits for
each to join group ``generation`` (rendezvous keys of its own) and build a new replica. What a
survivor sent before its ``Ready`` answers the old group's messages and is dropped; the
recovery then begins every replica from the restore point, as it would new workers.

Whatever keeps that from working in time (a survivor also dead, a lock a killed worker held,
a survivor in a long step) raises ``WorkerError``, and the recovery starts new workers.
"""

from __future__ import annotations

import contextlib
import queue
from collections.abc import Callable, Sequence
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue

from paraloom.training.failures import process_state
from paraloom.training.inbox import Inbox
from paraloom.training.messages import Pickled, Ready, Regroup, ToReplica

__all__ = ["REGROUP_S", "await_joined", "lost_ranks", "send_regroup"]

REGROUP_S = 20.0
"""How long a regroup may take at most: a survivor first ends the work in hand."""
_POLL_S = 0.05


def lost_ranks(procs: Sequence[BaseProcess], failed: int) -> list[int]:
    """The ranks to replace: ``failed``, and any other whose process has ended or is stopped
    (two failures at once)."""
    return [rank for rank, p in enumerate(procs) if rank == failed
            or p.exitcode is not None or process_state(p.pid) == "stopped"]


def send_regroup(tasks: Sequence[Queue[ToReplica | Pickled]], generation: int,
                 check: Callable[[], None]) -> None:
    """Queue ``Regroup(generation, rank)`` for every rank, behind what each has queued (it
    drops that); ``check()`` raises while a queue stays full."""
    for rank, q in enumerate(tasks):
        while True:
            try:
                q.put(Regroup(generation, rank), timeout=_POLL_S)
                break
            except queue.Full:
                check()


def await_joined(inbox: Inbox, workers: int, generation: int,
                 check: Callable[[], None]) -> None:
    """Wait for every worker's ``Ready`` from group ``generation``, dropping what came before
    it; ``check()`` raises (a worker ended, the time is up) between looks."""
    joined: set[int] = set()
    while len(joined) < workers:
        check()
        with contextlib.suppress(queue.Empty, OSError, EOFError):  # a dead worker's reply
            reply = inbox.get(_POLL_S)
            if isinstance(reply, Ready) and reply.generation == generation:
                joined.add(reply.rank)
