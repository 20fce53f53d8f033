"""A pool of spawned CPU processes in one gloo group, running test functions on every rank.

Spawning and importing torch costs seconds on a shared machine, so the pool lives for the
whole session; each ``run`` sends one function to every rank and waits for all results with a
hard deadline. A failure or a timeout kills the processes (a half-finished collective leaves
the group unusable) and the next ``run`` starts a fresh pool.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

_GROUP_TIMEOUT_S = 30  # every collective gives up after this


def _serve(rank: int, world_size: int, init_file: str, tasks: Any, results: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=_GROUP_TIMEOUT_S))
    try:
        while True:
            item = tasks.get()
            if item is None:
                break
            fn, args, kwargs = item
            try:
                results.put((rank, True, fn(rank, world_size, *args, **kwargs)))
            except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
                results.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class DistPool:
    """``world_size`` processes meeting through a FileStore; ``run`` returns results by rank."""

    def __init__(self, tmp_dir: Path, world_size: int = 2) -> None:
        self.tmp_dir = Path(tmp_dir)
        self.world_size = world_size
        self._generation = 0
        self._procs: list[Any] = []
        self._tasks: list[Any] = []
        self._results: Any = None

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._generation += 1
        init_file = self.tmp_dir / f"store-{self._generation}"
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [ctx.Process(target=_serve, daemon=True,
                                   args=(rank, self.world_size, str(init_file), self._tasks[rank],
                                         self._results))
                       for rank in range(self.world_size)]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 60.0,
            **kwargs: Any) -> list[Any]:
        """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank; fail on error or timeout."""
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.close()
            self._start()
        for q in self._tasks:
            q.put((fn, args, kwargs))
        deadline = time.monotonic() + timeout
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        while len(results) + len(errors) < self.world_size:
            remaining = deadline - time.monotonic()
            if errors:  # the others are probably stuck in a collective: give them a moment
                remaining = min(remaining, 5.0)
            try:
                rank, ok, value = self._results.get(timeout=max(0.01, remaining))
            except queue.Empty:
                dead = [i for i, p in enumerate(self._procs) if not p.is_alive()]
                self.close(force=True)
                detail = "\n".join(f"rank {r}:\n{tb}" for r, tb in errors.items())
                raise AssertionError(f"{fn.__name__} did not finish on every rank within "
                                     f"{timeout} s (dead ranks: {dead})\n{detail}") from None
            (results if ok else errors)[rank] = value
        if errors:
            self.close(force=True)
            detail = "\n".join(f"rank {r}:\n{tb}" for r, tb in sorted(errors.items()))
            raise AssertionError(f"{fn.__name__} failed:\n{detail}")
        return [results[rank] for rank in range(self.world_size)]

    def close(self, force: bool = False) -> None:
        """Stop the processes: politely (unless ``force``), then by killing them."""
        for q in self._tasks if not force else ():
            try:
                q.put(None)
            except (OSError, ValueError):
                pass
        for p in self._procs:
            p.join(timeout=0 if force else 5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._procs, self._tasks = [], []
