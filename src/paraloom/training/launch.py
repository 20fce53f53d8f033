"""Starting worker processes, and the spares a pool that survives failures keeps ready.

Workers are forked from a forkserver that has imported torch and the worker code once
(``worker_context``); each makes itself a process group, which ``kill_group`` ends with the
DataLoader processes it started. ``Launcher`` starts one worker for a rank, or a spare (rank
-1) that prepares its setup and waits to be given a rank (``messages.Regroup``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, MutableSequence
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from typing import TYPE_CHECKING

import torch.multiprocessing as mp  # registers the shared-memory tensor reductions

from paraloom.training.failures import process_state
from paraloom.training.messages import Pickled, Reply, ToReplica
from paraloom.training.sharer_hook import quiet_departed_fetchers
from paraloom.training.transport import fetched, release_unfetched
from paraloom.training.worker import WorkerConfig, worker_main

if TYPE_CHECKING:  # ForkServerContext does not exist on Windows
    from multiprocessing.context import ForkServerContext, SpawnContext

__all__ = ["Launcher", "SpareWorkers", "Worker", "kill_group", "no_main_reimport", "worker_context"]

log = logging.getLogger("paraloom")

_HANDLES_KEPT = 4096
"""Handles a worker's list keeps before those already fetched are dropped from it."""


@dataclass(frozen=True)
class Worker:
    """A worker's process, its task queue and its result queue."""

    process: BaseProcess
    tasks: Queue[ToReplica | Pickled]
    results: Queue[Reply]
    sent: list[int] = dataclasses.field(default_factory=list)
    """The descriptor handles of the messages put in ``tasks`` (``transport.dumps``), until
    fetched: released at ``close``, for the messages it never read."""

    def put(self, message: ToReplica | Pickled, timeout: float) -> None:
        """Put ``message`` in the task queue (``queue.Full`` after ``timeout`` s)."""
        self.tasks.put(message, timeout=timeout)
        if isinstance(message, Pickled) and message.handles:
            self.sent.extend(message.handles)
            if len(self.sent) > _HANDLES_KEPT:
                self.sent[:] = fetched(self.sent)

    def kill(self, killed: set[int]) -> None:
        """SIGKILL the process and its group, once: ``killed`` holds the pids killed (a pid
        is free for reuse once reaped, but not while its group has members left)."""
        p = self.process
        if p.pid is not None and p.pid not in killed:
            kill_group(p.pid, p.exitcode is None)
            killed.add(p.pid)

    def close(self) -> None:
        """Close its queues, without waiting for what they still hold, and release what the
        messages it never read held (their tensors' descriptors and shared memory)."""
        for q in (self.tasks, self.results):
            q.cancel_join_thread()
            q.close()
        if self.process.exitcode is not None or not self.process.is_alive():
            release_unfetched(self.sent)
            self.sent.clear()

    def discard(self, killed: set[int]) -> None:
        """``kill`` and ``close``."""
        self.kill(killed)
        self.close()


@contextlib.contextmanager
def no_main_reimport() -> Iterator[None]:
    """Spawned children normally re-run the user's script; ours get all they need by pickle.

    Hiding ``__main__``'s file and spec while the children start means a script without an
    ``if __name__ == "__main__":`` guard (or a notebook) does not start training again in each
    worker: the model, loss and optimizer travel by value with cloudpickle.
    """
    with _STARTING:  # spares start on threads of their own: one start at a time
        with _main_hidden():
            yield


_STARTING = threading.Lock()


@contextlib.contextmanager
def _main_hidden() -> Iterator[None]:
    main = sys.modules.get("__main__")
    saved: dict[str, object] = {
        k: main.__dict__[k] for k in ("__file__", "__spec__") if main and k in main.__dict__}
    try:
        if main is not None:
            main.__dict__.pop("__file__", None)
            main.__spec__ = None
        yield
    finally:
        if main is not None:
            main.__dict__.update(saved)
            if "__spec__" not in saved:
                main.__dict__.pop("__spec__", None)


def worker_context() -> ForkServerContext | SpawnContext:
    """How workers start: forked from a server process that has imported torch and the worker
    code once (a new worker starts in a fraction of a second instead of importing torch again,
    2-3 s each), or spawned where there is no forkserver (Windows) or
    ``PARALOOM_START_METHOD=spawn`` asks for it. Either way nothing of this process is
    inherited but what is sent: the forkserver is started clean, before any CUDA or threads."""
    method = os.environ.get("PARALOOM_START_METHOD", "forkserver")
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"PARALOOM_START_METHOD={method!r}; expected 'forkserver' or 'spawn'")
    quiet_departed_fetchers()
    if method == "forkserver" and "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        # torch._dynamo: torch.optim imports it on the first optimizer built (seconds).
        ctx.set_forkserver_preload(["paraloom.training.worker", "torch._dynamo"])
        _start_forkserver_deaf_to_ctrl_c()
        return ctx
    return mp.get_context("spawn")


def _start_forkserver_deaf_to_ctrl_c() -> None:
    """Start the forkserver (if it is not running) with SIGINT ignored: it imports torch
    before it ignores SIGINT itself, and a Ctrl-C at the terminal (sent to the whole process
    group) in those seconds killed it, so the next fit() failed with ``EOFError``. An
    ignored signal stays ignored across ``exec``; this process's handler is put back at once."""
    from multiprocessing import forkserver

    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers are the main thread's: the forkserver starts as it would
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGINT, previous)


def kill_group(pid: int, alive: bool) -> None:
    """SIGKILL a worker (``alive``) and its process group: the DataLoader processes it started,
    which would otherwise run on as orphans after it (for ever, if one hangs)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)  # the worker made its pid its group's id
    if alive:  # a worker still starting has no group of its own yet
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@dataclass
class Launcher:
    """Starts a pool's workers: each with a task queue and a result queue of its own, and
    the pool's heartbeat slots and round gate."""

    ctx: ForkServerContext | SpawnContext
    spec_bytes: bytes
    config: WorkerConfig
    """Every worker's settings but its rank and device."""
    beats: MutableSequence[float]
    gate_array: object
    queue_size: int
    devices: list[str]
    """Each rank's device (a spare's: the first)."""

    def start(self, rank: int) -> Worker:
        """Start the worker of ``rank`` (-1: a spare, which waits for a ``Regroup``)."""
        tasks: Queue[ToReplica | Pickled] = self.ctx.Queue(maxsize=max(1, self.queue_size))
        results: Queue[Reply] = self.ctx.Queue()
        name = f"paraloom-worker-{rank}" if rank >= 0 else "paraloom-spare"
        p = self.ctx.Process(target=worker_main, name=name, daemon=True,
                             args=(dataclasses.replace(self.config, rank=rank,
                                                       device=self.devices[max(rank, 0)]),
                                   self.spec_bytes,
                                   tasks, results, self.beats, self.gate_array))
        with no_main_reimport():
            p.start()
        return Worker(p, tasks, results)


class SpareWorkers:
    """Up to ``count`` spare workers, started ahead: a failed worker's place is taken by one
    that has paid for its start (a process from the forkserver, the setup unpickled) instead
    of waiting for a new one. The one taken is replaced ``restock_delay_s`` later, so that
    its start does not take CPU from the replay that follows a recovery (``poll`` starts it).
    """

    def __init__(self, launcher: Launcher, count: int, restock_delay_s: float = 1.0,
                 killed: set[int] | None = None) -> None:
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"spares={count!r}; expected an int >= 0")
        self.launcher, self.count, self.restock_delay_s = launcher, count, restock_delay_s
        self._ready: list[Worker] = []
        self._restock_at: float | None = None
        self._restocking: threading.Thread | None = None
        self._lock = threading.Lock()
        """``_ready`` is appended to by the restocking thread."""
        self.killed: set[int] = set() if killed is None else killed
        """The pids killed (``Worker.kill``): the pool's own set, shared."""
        self._retired: list[Worker] = []
        """Spares ``kill(wait=False)`` let go of: reaped by the next ``kill()``."""

    @property
    def pids(self) -> list[int]:
        """The process ids of the spares started and alive."""
        with self._lock:
            return [w.process.pid for w in self._ready
                    if w.process.pid is not None and w.process.exitcode is None]

    def fill(self) -> None:
        """Start spares up to ``count`` (on this thread)."""
        self._restock_at = None
        while True:
            with self._lock:
                if len(self._ready) >= self.count:
                    return
            worker = self.launcher.start(-1)
            with self._lock:
                if self.count == 0:  # killed meanwhile
                    worker.discard(self.killed)
                    return
                self._ready.append(worker)

    def poll(self) -> None:
        """Restock on a thread of its own (a start sends your setup to the forkserver), once
        the delay after a spare was taken has passed."""
        if self._restock_at is None or time.monotonic() < self._restock_at \
                or (self._restocking is not None and self._restocking.is_alive()):
            return
        self._restock_at = None
        self._restocking = threading.Thread(target=self._restock_now, name="paraloom-spare",
                                            daemon=True)
        self._restocking.start()

    def _restock_now(self) -> None:
        try:
            self.fill()
        except Exception as e:  # logged: a failure then starts a process of its own
            log.warning("paraloom: a spare worker could not start (%s)", e)

    def take(self) -> Worker:
        """A spare whose process is alive and not stopped, or a new worker (to be told its
        rank the same way, ``Regroup``) when there is none. A stopped spare (SIGSTOP) is
        killed: given a rank, it held the regroup up for its whole 20 s."""
        while True:
            with self._lock:
                worker = self._ready.pop(0) if self._ready else None
            if worker is None:
                break
            if worker.process.exitcode is None and process_state(worker.process.pid) != "stopped":
                self._restock()
                return worker
            worker.discard(self.killed)
        self._restock()
        return self.launcher.start(-1)

    def _restock(self) -> None:
        if self._restock_at is None:
            self._restock_at = time.monotonic() + self.restock_delay_s

    def kill(self, wait: bool = True) -> None:
        """Kill every spare (``wait``: and reap it); none is started after."""
        with self._lock:
            self.count, self._restock_at = 0, None
            ready, self._ready = self._ready, []
        for worker in ready:
            worker.discard(self.killed)
        if wait:
            retired, self._retired = [*self._retired, *ready], []
            for worker in retired:
                worker.process.join(timeout=5.0)
        else:
            self._retired.extend(ready)
