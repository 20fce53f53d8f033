"""ProcessPool: N worker processes in one torch.distributed group, fed through queues."""

from __future__ import annotations

import collections
import contextlib
import datetime
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Iterator, MutableSequence, Sequence
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from typing import TYPE_CHECKING, Any

import torch.multiprocessing as mp  # registers the shared-memory tensor reductions
from torch._C._distributed_c10d import TCPStore

from paraloom.devices import TrainingDevices, training_devices
from paraloom.errors import WorkerError
from paraloom.training.failures import death_message, failure_error, is_symptom, process_state
from paraloom.training.gate import RoundGate
from paraloom.training.inbox import Exited, Inbox
from paraloom.training.memory import worker_malloc
from paraloom.training.messages import (
    Answer,
    Begin,
    CheckpointReply,
    CheckpointRequest,
    Failed,
    Finish,
    Finished,
    Pickled,
    Ready,
    Reply,
    RestorePoint,
    RestorePointRequest,
    RoundBatch,
    RoundMessage,
    RoundsDone,
    StepDone,
    Stop,
    ToReplica,
)
from paraloom.training.transport import carries_user_objects, pack
from paraloom.training.worker import WorkerConfig, worker_main

if TYPE_CHECKING:  # ForkServerContext does not exist on Windows
    from multiprocessing.context import ForkServerContext, SpawnContext

__all__ = ["ProcessPool"]

_POLL_S = 0.05
"""How often a wait checks the workers (heartbeats, progress): a failure the replies do not
report and the process does not end (a stop, a hang) is seen this much later at most. A
worker that ends (killed, exited) is seen at once: the inbox watches the processes. A check
costs a few syscalls per worker."""


@contextlib.contextmanager
def _no_main_reimport() -> Iterator[None]:
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


def _context() -> ForkServerContext | SpawnContext:
    """How workers start: forked from a server process that has imported torch and the worker
    code once (a new worker starts in a fraction of a second instead of importing torch again,
    2-3 s each), or spawned where there is no forkserver (Windows) or
    ``PARALOOM_START_METHOD=spawn`` asks for it. Either way nothing of this process is
    inherited but what is sent: the forkserver is started clean, before any CUDA or threads."""
    method = os.environ.get("PARALOOM_START_METHOD", "forkserver")
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"PARALOOM_START_METHOD={method!r}; expected 'forkserver' or 'spawn'")
    if method == "forkserver" and "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        # torch._dynamo: torch.optim imports it on the first optimizer built (seconds).
        ctx.set_forkserver_preload(["paraloom.training.worker", "torch._dynamo"])
        return ctx
    return mp.get_context("spawn")


def _kill_group(pid: int, alive: bool) -> None:
    """SIGKILL a worker (``alive``) and its process group: the DataLoader processes it started,
    which would otherwise run on as orphans after it (for ever, if one hangs)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)  # the worker made its pid its group's id
    if alive:  # a worker still starting has no group of its own yet
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


class ProcessPool:
    """N worker processes in one torch.distributed group, fed through queues."""

    def __init__(self, spec_bytes: bytes, workers: int, *, timeout_s: float = 300.0,
                 step_timeout_s: float | None = None, heartbeat_timeout_s: float | None = 2.0,
                 startup_timeout_s: float = 120.0, queue_size: int = 4,
                 devices: TrainingDevices | None = None) -> None:
        plan = devices or training_devices("auto", workers)
        if plan.workers != workers:
            raise ValueError(f"devices for {plan.workers} workers given to a pool of {workers}")
        self.workers = workers
        self.timeout_s = timeout_s
        self.step_timeout_s = timeout_s if step_timeout_s is None else step_timeout_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.backend, self.devices, self.threads = plan.backend, list(plan.devices), plan.threads
        malloc = worker_malloc()
        ctx = _context()
        # One heartbeat slot per worker (0.0 until its first beat), written by its own thread.
        self._beats: MutableSequence[float] = ctx.Array("d", workers, lock=False)
        self._gate = RoundGate.create(ctx, workers)
        self._results: Queue[Reply] = ctx.Queue()
        self._inbox = Inbox(self._results)
        self._tasks: list[Queue[ToReplica | Pickled]] = [
            ctx.Queue(maxsize=max(1, queue_size)) for _ in range(workers)]
        # The parent hosts the rendezvous store on a port the OS picks (never a guessed port).
        self._store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        self._procs: list[BaseProcess] = []
        # Killed once only, on a failure's path (right after the worker's end was seen): a
        # pid is free for reuse once reaped, but not while its group has members left.
        self._groups_killed: set[int] = set()
        with _no_main_reimport():
            for rank in range(workers):
                cfg = WorkerConfig(rank=rank, world_size=workers, store_port=self._store.port,
                                   backend=self.backend, device=self.devices[rank],
                                   threads=self.threads, timeout_s=timeout_s,
                                   parent_pid=os.getpid(), malloc=malloc)
                p = ctx.Process(target=worker_main, name=f"paraloom-worker-{rank}", daemon=True,
                                args=(cfg, spec_bytes, self._tasks[rank], self._results,
                                      self._beats, self._gate.array))
                p.start()
                self._procs.append(p)
        self._inbox.watch([p.sentinel for p in self._procs])
        self._pending: collections.deque[Answer] = collections.deque()
        # Progress watchdog: work sent to a worker and not yet answered, and since when.
        self._outstanding = [0] * workers
        self._since = [time.monotonic()] * workers
        self._checked = time.monotonic()
        self._await_ready(startup_timeout_s)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    @property
    def warm(self) -> bool:
        return True

    def _await_ready(self, timeout_s: float) -> None:
        ready: set[int] = set()
        deadline = time.monotonic() + timeout_s
        while len(ready) < self.workers:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise WorkerError(f"workers {sorted(set(range(self.workers)) - ready)} did not "
                                  f"start within {timeout_s:.0f} s")
            reply = self._get(min(left, _POLL_S), starting=True)
            if isinstance(reply, Ready):
                ready.add(reply.rank)
            elif reply is not None:
                self._keep(reply)

    def begin(self, messages: Sequence[Begin]) -> None:
        """Start a fit() on every worker: ``messages[rank]`` to each.

        Tensors travel through shared memory: one pickle per worker, because each carries its
        own file-descriptor handles. Everything is pickled before anything is sent, so a
        dataset that cannot be pickled (NotPicklableError) leaves the workers untouched.
        """
        packed = [pack(message) for message in messages]
        self._gate.reset()
        for rank, message in enumerate(packed):
            self._put(rank, message)

    def halt(self, last: int | None = None) -> int:
        """Let the workers train no queued round after the one in flight (or ``last``);
        returns the last round they train."""
        return self._gate.halt(last)

    def send(self, rank: int, message: ToReplica) -> None:
        """Queue a message for one worker; waits (checking liveness) while its queue is full."""
        # A batch or a dataset may hold classes defined in the user's script: they travel by
        # value.
        self._put(rank, pack(message) if carries_user_objects(message) else message)
        answers = len(message.rounds) if isinstance(message, RoundBatch) else int(isinstance(
            message, RoundMessage | CheckpointRequest | RestorePointRequest | Finish))
        if answers:
            if self._outstanding[rank] == 0:
                self._since[rank] = time.monotonic()
            self._outstanding[rank] += answers

    def _put(self, rank: int, message: ToReplica | Pickled) -> None:
        while True:
            try:
                self._tasks[rank].put(message, timeout=_POLL_S)
                return
            except queue.Full:
                self._check_alive()
                self._absorb_replies()  # waiting replies count as progress (and may raise)

    def recv(self, timeout_s: float | None = None) -> Answer | None:
        """The next reply from any worker, or None after ``timeout_s``; raises WorkerError."""
        if self._pending:
            return self._pending.popleft()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left = _POLL_S if deadline is None else deadline - time.monotonic()
            reply = self._get(max(0.0, min(_POLL_S, left)))
            if isinstance(reply, RoundsDone):  # handed on one round at a time, in order
                self._keep(reply)
                return self._pending.popleft()
            if reply is not None and not isinstance(reply, Ready):
                return reply
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def _get(self, timeout_s: float, starting: bool = False) -> Answer | RoundsDone | Ready | None:
        try:
            reply = self._inbox.get(timeout_s)
            if isinstance(reply, Exited):  # a worker's process ended: see how, now
                self._check_alive(starting, drained=True)
                return None
        except queue.Empty:
            # A look for nothing (timeout 0, between rounds) checks the workers at most every
            # _POLL_S: each check polls every process (a few syscalls each).
            if timeout_s > 0 or time.monotonic() - self._checked > _POLL_S:
                self._check_alive(starting)
                if not starting:
                    self._check_progress()
            return None
        except (OSError, EOFError) as e:
            raise self._unreadable(e, starting) from e
        if isinstance(reply, Failed):
            raise self._error(reply, starting)
        if time.monotonic() - self._checked > _POLL_S:  # replies keep coming: check the rest
            self._check_alive(starting)
        if isinstance(reply, RoundsDone):
            rank, answers = reply.replies[0].rank, len(reply.replies)
        elif isinstance(reply, StepDone | CheckpointReply | RestorePoint | Finished):
            rank, answers = reply.rank, 1
        else:
            return reply
        self._outstanding[rank] -= answers
        self._since[rank] = time.monotonic()
        return reply

    def _unreadable(self, e: OSError | EOFError, starting: bool) -> WorkerError:
        """The error for a reply that could not be read: its tensors lived in a process that
        has just died, and could not be unpickled."""
        dead = self._silently_dead(set())
        if dead is not None and (self._procs[dead].exitcode or 0) >= 0:
            # It exited on its own: after reporting its error, which may come behind.
            report = self._reported_failure(0.5)
            if report is not None:
                return self._error(report, starting)
        self.kill(wait=False)
        if dead is not None:
            return self._death(dead, starting)
        return WorkerError(f"could not read a worker's reply: {e}")

    def _absorb_replies(self) -> None:
        """Move replies already waiting into the pending list, accounting for them."""
        while (reply := self._get(0)) is not None:
            if not isinstance(reply, Ready):
                self._keep(reply)

    def _keep(self, reply: Answer | RoundsDone) -> None:
        """Hold a reply for ``recv`` (a batch's, one round at a time, in order)."""
        if isinstance(reply, RoundsDone):
            self._pending.extend(reply.replies)
        else:
            self._pending.append(reply)

    def _check_progress(self) -> None:
        """Raise if a worker has had work and sent nothing for ``step_timeout_s`` (it hangs)."""
        now = time.monotonic()
        quiet = [rank for rank in range(self.workers)
                 if self._outstanding[rank] and now - self._since[rank] > self.step_timeout_s]
        if not quiet:
            return
        # A worker that never got to its loss hangs in its own code; its peers only wait for
        # it in a collective, and are quiet too.
        ranks = list(range(self.workers))
        stuck = self._gate.stuck(ranks)
        rank = (stuck or quiet)[0]
        where = "a collective, or the model's backward or optimizer step"
        if rank in self._gate.without_batch(ranks):
            where = "its data: the DataLoader or the dataset's code (it never got this round's " \
                "batch)"
        elif stuck:
            where = "the model or the loss (it never got to this round's loss)"
        # Its peers with work queued wait for it (quiet too, perhaps a poll short of the limit).
        waiting = [r for r in range(self.workers) if r != rank and self._outstanding[r]]
        others = f"; worker(s) {waiting} were waiting for it" if stuck and waiting else ""
        self.kill(wait=False)
        raise WorkerError(
            f"worker {rank} has answered nothing for {self.step_timeout_s:g} s "
            f"(step_timeout=, or timeout= when it is not set) with work queued: it hangs in "
            f"{where}{others}. It was killed with the other workers; raise step_timeout= if "
            "one step really takes that long", worker=rank)

    def _check_heartbeats(self, starting: bool = False) -> None:
        """Raise if a started worker's heartbeat stopped for ``heartbeat_timeout_s``."""
        if self.heartbeat_timeout_s is None:
            return
        now = time.monotonic()
        for rank, p in enumerate(self._procs):
            last = self._beats[rank]
            if last > 0.0 and now - last > self.heartbeat_timeout_s:
                state = process_state(p.pid)
                if state == "running":
                    continue  # busy in native code that holds the GIL: alive; step_timeout= rules
                # A worker that reported an error stops beating as it winds down: its report,
                # perhaps not read yet, is the cause. A stopped one reports nothing.
                report = self._reported_failure(0.0 if state == "stopped" else 0.5)
                if report is not None:
                    raise self._error(report, starting)
                self.kill(wait=False)
                raise WorkerError(
                    f"worker {rank} (pid {p.pid}) sent no heartbeat for {now - last:.1f} s "
                    f"(heartbeat_timeout={self.heartbeat_timeout_s:g}; process state: {state}):"
                    " it was stopped or is frozen. It was killed with the other workers",
                    worker=rank)

    def _check_alive(self, starting: bool = False, drained: bool = False) -> None:
        self._checked = time.monotonic()
        self._check_exits(starting, drained)
        self._check_heartbeats(starting)

    def _check_exits(self, starting: bool, drained: bool = False) -> None:
        """Raise if a worker's process has ended. ``drained``: the inbox said so (``EXITED``),
        behind everything the ended processes sent, which has been read: nothing to wait for."""
        exited = [rank for rank, p in enumerate(self._procs) if p.exitcode is not None]
        if not exited:
            return
        # A worker killed by a signal is the cause: it reported nothing, and a peer's report
        # (its connection broke) is a symptom of it.
        killed = [rank for rank in exited if (self._procs[rank].exitcode or 0) < 0]
        if not killed:
            # Workers that exited after reporting their errors: prefer those reports (a peer
            # may exit first, after reporting a symptom of the failure).
            report = self._reported_failure(0.0 if drained else 0.5)
            if report is not None:
                raise self._error(report, starting)
        self.kill(wait=False)
        raise self._death((killed or exited)[0], starting)

    def _reported_failure(self, within_s: float) -> Failed | None:
        """A failure report already taken from the inbox (``_absorb_replies``), else the first
        among the replies of the next ``within_s`` seconds."""
        taken = next((r for r in self._pending if isinstance(r, Failed)), None)
        return taken if taken is not None else self._next_failure(within_s)

    def _next_failure(self, within_s: float) -> Failed | None:
        """The first failure report among the replies of the next ``within_s`` seconds (the
        fit is ending in an error: the other replies are dropped)."""
        deadline = time.monotonic() + within_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                reply = self._inbox.get(left)
            except queue.Empty:
                return None
            except (OSError, EOFError):
                # A reply whose tensors lived in the worker that has exited: dropped, as the
                # others are; the report may come behind it.
                continue
            if isinstance(reply, Failed):
                return reply
            self._salvage(reply)
        return None

    def _salvage(self, reply: object) -> None:
        """Keep a checkpoint reply that came in while a failure is handled, for ``recv`` to
        hand on (its checkpoint may be complete: nothing the workers saved is lost)."""
        if isinstance(reply, CheckpointReply):
            self._pending.append(reply)

    def _error(self, first: Failed, starting: bool) -> WorkerError:
        """The error to raise for a failure report: its cause, not a peer's symptom of it."""
        errors = sorted(self._collect_errors(first), key=lambda f: is_symptom(f.message))
        cause = errors[0]
        if is_symptom(cause.message):  # a peer's connection broke: was a worker killed outright?
            dead = self._silently_dead({f.rank for f in errors})
            if dead is not None:
                self.kill(wait=False)
                error = self._death(dead, starting)
                error.batch = cause.round_id
                return error
        self.kill(wait=False)
        return failure_error(cause, starting)

    def _death(self, rank: int, starting: bool) -> WorkerError:
        p = self._procs[rank]
        return WorkerError(death_message(rank, p.pid, p.exitcode, starting), worker=rank)

    def _collect_errors(self, first: Failed) -> list[Failed]:
        """The first error, when it is a cause itself; else it and any others that follow
        within half a second, less once every worker has reported or exited (a killed worker
        reports nothing, and one that exits after reporting has its report queued already)."""
        errors = [first]
        if not is_symptom(first.message):
            return errors  # the cause itself (the others' reports are symptoms of it)
        deadline = time.monotonic() + 0.5
        while (now := time.monotonic()) < deadline:
            silent = set(range(self.workers)) - {f.rank for f in errors}
            if not silent:
                break
            codes = [self._procs[rank].exitcode for rank in silent]
            if all(code is not None and code < 0 for code in codes):
                break  # killed by a signal: they report nothing
            if all(code is not None for code in codes):
                # What an exited worker reported is in the pipe already.
                deadline = min(deadline, now + 0.02)
            # Other replies are salvaged or, unreadable once their worker exited, dropped.
            report = self._next_failure(min(0.05, deadline - time.monotonic()))
            if report is not None:
                errors.append(report)
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
                    self._tasks[rank].put(Stop(), timeout=1.0)
        deadline = time.monotonic() + timeout_s
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.exitcode == 0 and p.pid is not None:
                # Stopped as asked: its loader processes ended with it, and its pid, reaped
                # now, may be another process's soon: its group is not killed.
                self._groups_killed.add(p.pid)
        self.kill()

    def kill(self, wait: bool = True) -> None:
        """Terminate every worker now; safe to call twice. ``wait``: and reap the processes
        and the thread reading their replies (False: a failure's path, where a recovery
        follows at once; the next ``kill()`` or ``close()`` reaps them)."""
        for p in self._procs:
            if p.pid is not None and p.pid not in self._groups_killed:
                _kill_group(p.pid, p.is_alive())
                self._groups_killed.add(p.pid)
        if wait:
            for p in self._procs:
                p.join(timeout=5.0)
        self._inbox.close(wait)
        queues: list[Queue[Any]] = [*self._tasks, self._results]
        for q in queues:
            q.cancel_join_thread()
            q.close()
