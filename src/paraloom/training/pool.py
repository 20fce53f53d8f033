"""Worker pools: processes that hold replicas, or the calling process for one worker."""

from __future__ import annotations

import collections
import contextlib
import datetime
import os
import queue
import signal
import sys
import time
import traceback
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp  # registers the shared-memory tensor reductions

from paraloom.errors import NotPicklableError, WorkerError
from paraloom.training.transport import dumps
from paraloom.training.worker import ReplicaRunner, WorkerConfig, WorkerSpec, worker_main

__all__ = ["ProcessPool", "LocalPool", "device_plan"]

_POLL_S = 0.2
# Errors that are a symptom of a peer's failure, not a cause: report another one if any.
_SYMPTOMS = ("Connection closed by peer", "Connection reset", "Gloo", "NCCL", "timed out",
             "Broken pipe", "parent process exited")


def device_plan(workers: int) -> tuple[str, list[str], int]:
    """(backend, device per worker, threads per worker) for this machine."""
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        return "nccl", [f"cuda:{i % n}" for i in range(workers)], 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return "gloo", ["cpu"] * workers, max(1, (cores or 1) // workers)


@contextlib.contextmanager
def _no_main_reimport() -> Iterator[None]:
    """Spawned children normally re-run the user's script; ours get all they need by pickle.

    Hiding ``__main__``'s file and spec while the children start means a script without an
    ``if __name__ == "__main__":`` guard (or a notebook) does not start training again in each
    worker: the model, loss and optimizer travel by value with cloudpickle.
    """
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if main and k in main.__dict__}
    try:
        if main is not None:
            main.__dict__.pop("__file__", None)
            main.__spec__ = None  # type: ignore[assignment]
        yield
    finally:
        if main is not None:
            main.__dict__.update(saved)
            if "__spec__" not in saved:
                main.__dict__.pop("__spec__", None)


class ProcessPool:
    """N spawned worker processes in one torch.distributed group, fed through queues."""

    def __init__(self, spec_bytes: bytes, workers: int, *, timeout_s: float = 300.0,
                 startup_timeout_s: float = 120.0, queue_size: int = 4) -> None:
        self.workers = workers
        self.timeout_s = timeout_s
        self.backend, self.devices, self.threads = device_plan(workers)
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue(maxsize=max(1, queue_size)) for _ in range(workers)]
        # The parent hosts the rendezvous store on a port the OS picks (never a guessed port).
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        self._procs = []
        with _no_main_reimport():
            for rank in range(workers):
                cfg = WorkerConfig(rank=rank, world_size=workers, store_port=self._store.port,
                                   backend=self.backend, device=self.devices[rank],
                                   threads=self.threads, timeout_s=timeout_s,
                                   parent_pid=os.getpid())
                p = ctx.Process(target=worker_main, name=f"paraloom-worker-{rank}", daemon=True,
                                args=(cfg, spec_bytes, self._tasks[rank], self._results))
                p.start()
                self._procs.append(p)
        self._pending: collections.deque[Any] = collections.deque()
        # Progress watchdog: work sent to a worker and not yet answered, and since when.
        self._outstanding = [0] * workers
        self._since = [time.monotonic()] * workers
        self._await_ready(startup_timeout_s)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    def _await_ready(self, timeout_s: float) -> None:
        ready: set[int] = set()
        deadline = time.monotonic() + timeout_s
        while len(ready) < self.workers:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise WorkerError(f"workers {sorted(set(range(self.workers)) - ready)} did not "
                                  f"start within {timeout_s:.0f} s")
            msg = self._get(min(left, _POLL_S), starting=True)
            if msg is not None and msg[0] == "ready":
                ready.add(msg[1])
            elif msg is not None:
                self._pending.append(msg)

    def begin(self, state: dict[str, torch.Tensor], dataset: Any,
              snapshots: list[Any] | None = None, optimizer_state: Any = None,
              seed: int | None = None) -> None:
        """Start a fit() on every worker: master state, and the dataset for index dealing.

        Tensors travel through shared memory: one pickle per worker, because each carries its
        own file-descriptor handles. Everything is pickled before
        anything is sent, so a dataset that cannot be pickled (NotPicklableError) leaves the
        workers untouched.
        """
        messages = []
        for rank in range(self.workers):
            snap = snapshots[rank] if snapshots else None
            messages.append(("begin", _dumps(state), _dumps(dataset, "dataset"), _dumps(snap),
                             _dumps(optimizer_state), seed))
        for rank, msg in enumerate(messages):
            self.send(rank, msg)

    def send(self, rank: int, msg: Any) -> None:
        """Queue a message for one worker; waits (checking liveness) while its queue is full."""
        if msg[0] == "round" and msg[2] is not None and msg[2][0] == "batch":
            msg = ("round", msg[1], ("pickled", dumps(msg[2][1])))  # script classes by value
        while True:
            try:
                self._tasks[rank].put(msg, timeout=_POLL_S)
                break
            except queue.Full:
                self._check_alive()
                self._absorb_replies()  # waiting replies count as progress (and may raise)
        if msg[0] in ("round", "snapshot", "finish"):
            if self._outstanding[rank] == 0:
                self._since[rank] = time.monotonic()
            self._outstanding[rank] += 1

    def recv(self, timeout_s: float | None = None) -> Any:
        """The next reply from any worker, or None after ``timeout_s``; raises WorkerError."""
        if self._pending:
            return self._pending.popleft()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left = _POLL_S if deadline is None else deadline - time.monotonic()
            wait = max(0.0, min(_POLL_S, left))
            msg = self._get(wait)
            if msg is not None:
                return msg
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def _get(self, timeout_s: float, starting: bool = False) -> Any:
        try:
            msg = self._results.get(timeout=timeout_s) if timeout_s > 0 else \
                self._results.get_nowait()
        except queue.Empty:
            self._check_alive(starting)
            if not starting:
                self._check_progress()
            return None
        except (OSError, EOFError) as e:
            # A reply whose tensors live in a process that has just died cannot be unpickled.
            dead = self._silently_dead(set())
            self.kill()
            if dead is not None:
                raise WorkerError(_death_message(dead, self._procs[dead].pid,
                                                 self._procs[dead].exitcode, starting),
                                  worker=dead) from e
            raise WorkerError(f"could not read a worker's reply: {e}") from e
        if msg[0] == "error":
            self._raise_error(msg, starting)
        if msg[0] in ("step", "snapshot", "finished"):
            rank = msg[1]
            self._outstanding[rank] -= 1
            self._since[rank] = time.monotonic()
        return msg

    def _absorb_replies(self) -> None:
        """Move replies already waiting into the pending list, accounting for them."""
        while (msg := self._get(0)) is not None:
            self._pending.append(msg)

    def _check_progress(self) -> None:
        """Raise if a worker has had work and sent nothing for ``timeout_s`` (it is stuck)."""
        now = time.monotonic()
        for rank in range(self.workers):
            if self._outstanding[rank] and now - self._since[rank] > self.timeout_s:
                self.kill()
                raise WorkerError(
                    f"worker {rank} has answered nothing for {self.timeout_s:.0f} s (timeout=) "
                    "with work queued: it is stuck in the model, the loss or the data code. "
                    "The other workers were stopped; raise timeout= if one step really takes "
                    "that long", worker=rank)

    def _check_alive(self, starting: bool = False) -> None:
        for rank, p in enumerate(self._procs):
            if p.exitcode is not None:
                # A worker that reported its error before exiting: prefer that report.
                with contextlib.suppress(queue.Empty, OSError, EOFError):
                    msg = self._results.get(timeout=0.5)
                    if msg[0] == "error":
                        self._raise_error(msg, starting)
                self.kill()
                raise WorkerError(_death_message(rank, p.pid, p.exitcode, starting), worker=rank)

    def _raise_error(self, first: tuple, starting: bool) -> None:
        errors = self._collect_errors(first)
        errors.sort(key=lambda m: _is_symptom(m[3]))
        _, rank, round_id, message, tb, kind = errors[0]
        if _is_symptom(message):  # a peer's connection broke: was a worker killed outright?
            dead = self._silently_dead({m[1] for m in errors})
            if dead is not None:
                self.kill()
                raise WorkerError(_death_message(dead, self._procs[dead].pid,
                                                 self._procs[dead].exitcode, starting),
                                  worker=dead, batch=round_id)
        self.kill()
        where = f" on round {round_id}" if round_id is not None else ""
        hint = " while starting" if starting else ""
        raise WorkerError(f"worker {rank} failed{hint}{where}: {message}", worker=rank,
                          batch=round_id, remote_traceback=tb, remote_type=kind)

    def _collect_errors(self, first: tuple) -> list[tuple]:
        """The first error and any others that follow within half a second."""
        errors = [first]
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            try:
                msg = self._results.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if msg[0] == "error":
                errors.append(msg)
        return errors

    def _silently_dead(self, reported: set[int]) -> int | None:
        """A worker that died without reporting an error (e.g. SIGKILL), if any, within 2 s."""
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            for rank, p in enumerate(self._procs):
                if rank not in reported and p.exitcode is not None:
                    return rank
            time.sleep(0.05)
        return None

    def close(self, timeout_s: float = 10.0) -> None:
        """Ask the workers to stop; kill those that do not within ``timeout_s``."""
        for rank, p in enumerate(self._procs):
            if p.is_alive():
                with contextlib.suppress(Exception):
                    self._tasks[rank].put(("stop",), timeout=1.0)
        deadline = time.monotonic() + timeout_s
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """Terminate every worker now and reap it; safe to call twice."""
        for p in self._procs:
            if p.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
        for p in self._procs:
            p.join(timeout=5.0)
        for q in (*self._tasks, self._results):
            q.cancel_join_thread()
            q.close()

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)


def _dumps(obj: Any, what: str = "state") -> bytes | None:
    if obj is None:
        return None
    try:
        return dumps(obj)
    except Exception as e:
        raise NotPicklableError(f"the {what} cannot be sent to the workers: "
                                f"{type(e).__name__}: {e}") from e


def _is_symptom(message: str) -> bool:
    lowered = message.lower()
    return any(s.lower() in lowered for s in _SYMPTOMS)


def _death_message(rank: int, pid: int | None, code: int | None, starting: bool) -> str:
    how = f"was killed by signal {-code}" if code is not None and code < 0 else \
        f"exited with code {code}"
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            how = f"was killed by {signal.Signals(-code).name}"
    msg = f"worker {rank} (pid {pid}) {how}"
    if starting:
        msg += (" while starting; its stderr above says why (out of memory? an import that "
                "fails in a fresh process? then define the model at module level)")
    return msg + "; the other workers were stopped"


class LocalPool:
    """``workers=1``: the replica lives in the calling process; same protocol, no queues."""

    def __init__(self, spec: WorkerSpec, device: str = "cpu") -> None:
        self.workers = 1
        self.backend, self.devices, self.threads = "none", [device], torch.get_num_threads()
        self._runner = ReplicaRunner(spec, device=device)
        self._replies: collections.deque[Any] = collections.deque()
        self.pids: list[int] = []

    def begin(self, state: dict[str, torch.Tensor], dataset: Any,
              snapshots: list[Any] | None = None, optimizer_state: Any = None,
              seed: int | None = None) -> None:
        # No seed: the replica shares the caller's RNG, which the caller has seeded.
        self._runner.begin(state, dataset, snapshots[0] if snapshots else None, optimizer_state)

    def send(self, rank: int, msg: Any) -> None:
        round_id = msg[1] if msg[0] == "round" else None
        try:
            if msg[0] == "round":
                self._replies.append(("step", 0, round_id, *self._runner.round(msg[2])))
            elif msg[0] == "snapshot":
                self._replies.append(("snapshot", 0, msg[1], self._runner.replica.snapshot()))
            elif msg[0] == "finish":
                self._replies.append(("finished", 0, self._runner.finish(send_state=True)))
        except Exception as e:
            raise WorkerError(f"training failed on round {round_id}: {type(e).__name__}: {e}",
                              worker=0, batch=round_id, remote_traceback=traceback.format_exc(),
                              remote_type=type(e).__name__) from e

    def recv(self, timeout_s: float | None = None) -> Any:
        return self._replies.popleft() if self._replies else None

    def close(self, timeout_s: float = 10.0) -> None:
        pass

    def kill(self) -> None:
        pass

    @property
    def alive(self) -> bool:
        return True
