"""PyTorch DDP baselines: rank processes in one gloo group, started and collected the same way
by every benchmark."""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# torch.distributed re-exports TCPStore from here without naming it in an __all__.
from torch._C._distributed_c10d import TCPStore

if TYPE_CHECKING:
    from multiprocessing.queues import Queue

    from typing_extensions import TypeVarTuple, Unpack

    _Args = TypeVarTuple("_Args")

__all__ = ["join_group", "run_ranks"]

_TIMEOUT = datetime.timedelta(seconds=120)
_Reply = TypeVar("_Reply")


def join_group(rank: int, world: int, port: int, threads: int, backend: str = "gloo") -> None:
    """In a rank process: ``threads`` torch threads, then the group (gloo, or NCCL for one GPU
    per rank) of the parent's store."""
    torch.set_num_threads(threads)
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=_TIMEOUT)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=_TIMEOUT)


def run_ranks(target: Callable[[int, int, int, Unpack[_Args], Queue[_Reply]], None], world: int,
              args: tuple[Unpack[_Args]], *, replies: int, timeout_s: float,
              daemon: bool = True) -> list[_Reply]:
    """Start ``world`` spawned ranks as ``target(rank, world, port, *args, out)`` and return
    the first ``replies`` items they put on ``out``; every rank is joined (killed if stuck).
    ``daemon=False`` lets ranks start processes of their own (DataLoader workers)."""
    ctx = mp.get_context("spawn")
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=_TIMEOUT)
    out: Queue[_Reply] = ctx.Queue()
    procs = [ctx.Process(target=target, daemon=daemon, args=(r, world, store.port, *args, out))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        return [out.get(timeout=timeout_s) for _ in range(replies)]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
