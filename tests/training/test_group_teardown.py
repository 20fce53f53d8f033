"""A worker leaves a failed process group at once and without a deadlock (``training.group``).

Freeing a gloo group joins its worker threads while the freeing thread holds the GIL; a
collective started in a backward pass holds a Python object in its thread-local state (the
``contextvars`` context torch stashes for the autograd engine), and a worker thread freeing
it waits for the GIL: a survivor that freed its group while such a collective was still
failing hung for good (the regroup gave up after 20 s), in about one recovery in eight of the
chaos benchmark. ``Membership.leave`` shuts the group's connections down (a peer waiting on
this worker gets its error at once, and so do this worker's own collectives) and frees the
group only at the next ``leave``.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import signal
import socket
import sys
import time
from collections.abc import Callable

import pytest

pytestmark = pytest.mark.timeout(60)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pair(target: Callable[..., None], timeout_s: float) -> list[object]:
    """Run ``target(rank, port, results)`` in two processes; what rank 0 puts, until None."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=target, args=(r, port, results), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        out = []
        while (item := results.get(timeout=timeout_s)) is not None:
            out.append(item)
        return out
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)


def _joined(rank: int, port: int, generation: int = 0):  # type: ignore[no-untyped-def]
    import torch
    import torch.distributed as dist

    from paraloom.training.group import Membership

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0,
                          timeout=datetime.timedelta(seconds=20))
    membership = Membership()
    membership.join(store, rank, 2, "gloo", 20.0, generation)
    return store, membership


def _peer_died(rank: int, port: int, results: mp.Queue) -> None:  # type: ignore[type-arg]
    import torch
    import torch._dynamo  # noqa: F401  (as the forkserver preloads it for every worker)
    from torch import nn

    store, membership = _joined(rank, port)
    torch.manual_seed(0)
    # Many buckets: collectives still queued, failing one by one, as the survivor leaves.
    model = nn.Sequential(*[nn.Linear(128, 128) for _ in range(32)])
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)
    x = torch.randn(64, 128)
    for _ in range(3):  # past the first steps (DDP then rebuilds its buckets)
        ddp(x).sum().backward()
    if rank == 1:
        time.sleep(0.3)
        os._exit(0)
    with pytest.raises(RuntimeError):
        ddp(x).sum().backward()
    # Keep the GIL from gloo's threads, still failing the queued collectives, but where this
    # thread waits: freeing the group right away joined them, and they waited for the GIL.
    sys.setswitchinterval(5.0)
    started = time.monotonic()
    membership.leave()
    del ddp, model  # DDP's reducer: the group's last holder but ``membership``
    results.put(time.monotonic() - started)
    results.put(None)


def test_a_survivor_leaves_the_group_of_a_dead_peer_without_a_deadlock():
    (seconds,) = _pair(_peer_died, timeout_s=15)
    assert seconds < 2.0


def _peer_left(rank: int, port: int, results: mp.Queue) -> None:  # type: ignore[type-arg]
    import torch
    from torch import nn

    store, membership = _joined(rank, port)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)
    x = torch.randn(8, 64)
    ddp(x).sum().backward()
    if rank == 1:  # leaves the group, its process and its group's object kept for 30 s
        time.sleep(0.2)
        membership.leave()
        time.sleep(30)
        return
    started = time.monotonic()
    with pytest.raises(RuntimeError):
        ddp(x).sum().backward()
    results.put(time.monotonic() - started)
    membership.leave()
    del ddp, model
    results.put(None)


def test_a_peer_that_leaves_ends_the_collective_waiting_on_it_at_once():
    (seconds,) = _pair(_peer_left, timeout_s=15)
    assert seconds < 5.0  # the group's timeout is 20 s; rank 1's process lives on




def _spark_ranks_leave(rank: int, port: int, results: mp.Queue) -> None:  # type: ignore[type-arg]
    import torch
    import torch.distributed as dist

    from paraloom.spark.training.board import leave_group
    from paraloom.spark.training.rendezvous import MEMBERSHIP, Rendezvous, init_group

    if rank == 1:
        time.sleep(1.0)  # connects to rank 0's store while rank 0 waits in the group's forming
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=10))  # as the stage's store
    group = init_group(Rendezvous("127.0.0.1", port, "run", ()), rank, 2, "gloo", 10.0, store)
    dist.all_reduce(torch.ones(4))
    if rank == 0:
        leave_group()
        store.set("left", "1")
        store.wait(["after"])  # rank 1 still reaches the store (a failed task's error board)
        results.put((store.get("after"), MEMBERSHIP._retired is group))
        results.put(None)
    else:
        store.wait(["left"])
        leave_group()
        store.set("after", "ok")
    time.sleep(1)


def test_a_spark_task_leaves_its_group_keeping_the_group_and_its_store():
    """A Spark task's group is left as a pool worker's is (its connections closed, its object
    kept until the next group is left: freeing it as the task ended deadlocked the Python
    worker in about half the fits of SharedTrainingMaster(synchronizer=AllReduce()), see
    test_training.py), but rank 0 serves the stage's store: a peer's connection to it,
    accepted while the group formed, is not the group's and stays open."""
    ((after, kept),) = _pair(_spark_ranks_leave, timeout_s=30)
    assert after == b"ok" and kept
