"""ProcessPool: N worker processes in one torch.distributed group, fed through queues."""

from __future__ import annotations

import collections
import contextlib
import datetime
import functools
import os
import queue
import time
from collections.abc import MutableSequence, Sequence
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue

from paraloom.devices import TrainingDevices, training_devices
from paraloom.errors import WorkerError
from paraloom.training.failures import (
    collect_errors,
    death_message,
    failure_error,
    frozen,
    is_symptom,
    last_round,
    next_failure,
    process_state,
    silently_dead,
)
from paraloom.training.gate import RoundGate
from paraloom.training.inbox import Exited, Inbox
from paraloom.training.launch import Launcher, SpareWorkers, Worker, worker_context
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
    RestorePoint,
    RestorePointRequest,
    RoundBatch,
    RoundMessage,
    RoundsDone,
    StepDone,
    Stop,
    ToReplica,
)
from paraloom.training.regroup import REGROUP_S, await_joined, lost_ranks, send_regroup
from paraloom.training.store import listening_store
from paraloom.training.transport import carries_user_objects, pack
from paraloom.training.worker import WorkerConfig

__all__ = ["ProcessPool"]

_POLL_S = 0.05
"""How long a put into a full queue, or a wait for the workers to start, waits between checks."""


def check_interval(heartbeat_timeout_s: float | None) -> float:
    """How often a wait checks the workers (heartbeats, progress): an eighth of the heartbeat
    timeout, from 0.05 to 0.25 s. A failure the replies do not report and the process does not
    end (a stop, a hang) is seen this much later at most; a worker that ends (killed, exited) is
    seen at once: the inbox watches the processes. A check costs a few syscalls per worker,
    and each timed wake-up of a waiting thread about 0.1 ms of CPU on a VM: 20 a second took
    0.5-1% of a core from the workers."""
    if heartbeat_timeout_s is None:
        return 0.25
    return min(0.25, max(0.05, heartbeat_timeout_s / 8))


class ProcessPool:
    """N worker processes in one torch.distributed group, fed through queues."""

    def __init__(self, spec_bytes: bytes, workers: int, *, timeout_s: float = 300.0,
                 step_timeout_s: float | None = None, heartbeat_timeout_s: float | None = 2.0,
                 startup_timeout_s: float = 120.0, queue_size: int = 4,
                 devices: TrainingDevices | None = None, survive: bool = False,
                 spares: int = 0) -> None:
        plan = devices or training_devices("auto", workers)
        if plan.workers != workers:
            raise ValueError(f"devices for {plan.workers} workers given to a pool of {workers}")
        self.workers = workers
        self.timeout_s = timeout_s
        self.step_timeout_s = timeout_s if step_timeout_s is None else step_timeout_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._check_s = check_interval(heartbeat_timeout_s)
        self.backend, self.devices, self.threads = plan.backend, list(plan.devices), plan.threads
        self.survive = survive and self.backend == "gloo" and workers > 1 \
            and all(d == "cpu" for d in self.devices)
        """A failure kills the failed worker only, and ``regroup`` replaces it (gloo's
        collectives end in an error when a peer's process dies; NCCL's hang)."""
        ctx = worker_context()
        # One heartbeat slot per worker (0.0 until its first beat), written by its own thread.
        self._beats: MutableSequence[float] = ctx.Array("d", workers, lock=False)
        self._gate = RoundGate.create(ctx, workers)
        self._inbox = Inbox()
        # The parent hosts the rendezvous store on a port the OS picks (never a guessed port),
        # listening on the loopback address only.
        self._store = listening_store("127.0.0.1", 0, datetime.timedelta(seconds=timeout_s))
        config = WorkerConfig(rank=-1, world_size=workers, store_port=self._store.port,
                              backend=self.backend, device="cpu", threads=self.threads,
                              timeout_s=timeout_s, parent_pid=os.getpid(),
                              malloc=worker_malloc(), survive=self.survive)
        self._launcher = Launcher(ctx, spec_bytes, config, self._beats,
                                  self._gate.array, queue_size, self.devices)
        # Killed once only, on a failure's path (right after the worker's end was seen): a
        # pid is free for reuse once reaped, but not while its group has members left.
        self._groups_killed: set[int] = set()
        self._spares = SpareWorkers(self._launcher, spares if self.survive else 0,
                                    killed=self._groups_killed)
        self.generation = 0
        """The process group's: ``regroup`` forms the next."""
        self._workers = [self._launcher.start(rank) for rank in range(workers)]
        self._procs: list[BaseProcess] = [w.process for w in self._workers]
        self._tasks: list[Queue[ToReplica | Pickled]] = [w.tasks for w in self._workers]
        self._replaced: list[Worker] = []
        """Workers that ``regroup`` replaced: killed, reaped by ``kill``."""
        self._killed = False
        self._inbox.watch([p.sentinel for p in self._procs], [w.results for w in self._workers])
        self._pending: collections.deque[Answer] = collections.deque()
        # Progress watchdog: work sent to a worker and not yet answered, and since when.
        self._outstanding = [0] * workers
        self._since = [time.monotonic()] * workers
        self._checked = time.monotonic()
        try:
            self._await_ready(startup_timeout_s)
        except BaseException:  # a failure while starting kills every worker, survive or not
            self.kill()
            raise
        self._spares.fill()

    @property
    def spare_pids(self) -> list[int]:
        """Process ids of the spare workers started (``spares=``, with ``survive``)."""
        return self._spares.pids

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    @property
    def alive(self) -> bool:
        """Whether every worker can train: its process runs, and is not dying or stopped (a
        worker killed or frozen between two fits makes the next one start a fresh pool,
        whether it looks a millisecond after the signal or a second)."""
        return bool(self._procs) and all(p.is_alive() and not frozen(p.pid) for p in self._procs)

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
                self._workers[rank].put(message, timeout=_POLL_S)
                return
            except queue.Full:
                self._check_alive()
                self._absorb_replies()  # waiting replies count as progress (and may raise)
                # A full queue is a worker with work queued: one that hangs is found here too,
                # or a hang mid-epoch waited for the collectives' timeout (300 s by default).
                self._check_progress()

    def recv(self, timeout_s: float | None = None) -> Answer | None:
        """The next reply from any worker, or None after ``timeout_s``; raises WorkerError."""
        if self._pending:
            return self._pending.popleft()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left = self._check_s if deadline is None else deadline - time.monotonic()
            reply = self._get(max(0.0, min(self._check_s, left)))
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
            # _check_s: each check polls every process (a few syscalls each).
            if timeout_s > 0 or time.monotonic() - self._checked > self._check_s:
                self._check_alive(starting)
                if not starting:
                    self._check_progress()
            return None
        except (OSError, EOFError) as e:
            raise self._unreadable(e, starting) from e
        if isinstance(reply, Failed):
            raise self._error(reply, starting)
        if time.monotonic() - self._checked > self._check_s:  # replies keep coming: check
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
        dead = silently_dead(self._procs, set())
        if dead is not None and (self._procs[dead].exitcode or 0) >= 0:
            # It exited on its own: after reporting its error, which may come behind.
            report = self._reported_failure(0.5)
            if report is not None:
                return self._error(report, starting)
        self._fail(dead)
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
        self._fail(rank)
        round_id = self._gate.started(rank)
        raise WorkerError(
            f"worker {rank} has answered nothing for {self.step_timeout_s:g} s (step_timeout="
            f", or timeout= when it is not set) with work queued{last_round(round_id)}: it "
            f"hangs in {where}{others}. It was killed{self._with_others}; "
            "raise step_timeout= if one step really takes that long", worker=rank,
            batch=round_id, silent_seconds=now - self._since[rank])

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
                self._fail(rank)
                round_id = self._gate.started(rank)
                raise WorkerError(
                    f"worker {rank} (pid {p.pid}){last_round(round_id)} sent no heartbeat for "
                    f"{now - last:.1f} s (heartbeat_timeout={self.heartbeat_timeout_s:g}; "
                    f"process state: {state}): it was stopped or is frozen. It was killed"
                    f"{self._with_others}", worker=rank, batch=round_id,
                    silent_seconds=now - last)

    def _check_alive(self, starting: bool = False, drained: bool = False) -> None:
        self._checked = time.monotonic()
        self._check_exits(starting, drained)
        self._check_heartbeats(starting)
        self._spares.poll()

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
        self._fail((killed or exited)[0])
        raise self._death((killed or exited)[0], starting)

    def _reported_failure(self, within_s: float) -> Failed | None:
        """A failure report already taken from the inbox (``_absorb_replies``), else the first
        among the replies of the next ``within_s`` seconds."""
        taken = next((r for r in self._pending if isinstance(r, Failed)), None)
        return taken if taken is not None else self._next_failure(within_s)

    def _next_failure(self, within_s: float) -> Failed | None:
        return next_failure(self._inbox, within_s, self._salvage)

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
            dead = silently_dead(self._procs, {f.rank for f in errors})
            if dead is not None:
                self._fail(dead)
                return self._death(dead, starting)
        self._fail(cause.rank)
        return failure_error(cause, starting)

    def _death(self, rank: int, starting: bool) -> WorkerError:
        p, round_id = self._procs[rank], self._gate.started(rank)
        return WorkerError(death_message(rank, p.pid, p.exitcode, starting, not self.survive,
                                         round_id), worker=rank, batch=round_id)

    def _collect_errors(self, first: Failed) -> list[Failed]:
        return collect_errors(first, self._procs, self._next_failure)

    def close(self, timeout_s: float = 10.0) -> None:
        """Ask the workers to stop; kill those that do not within ``timeout_s`` (a stopped or
        dying one at once: it cannot answer)."""
        stuck = [frozen(p.pid) for p in self._procs]
        for rank, p in enumerate(self._procs):
            if p.is_alive() and not stuck[rank]:
                with contextlib.suppress(Exception):
                    self._tasks[rank].put(Stop(), timeout=1.0)
        deadline = time.monotonic() + timeout_s
        for p, cannot in zip(self._procs, stuck, strict=True):
            if cannot:
                continue
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
        self._killed = True
        self._spares.kill(wait)
        for worker in self._workers:
            worker.kill(self._groups_killed)
        if wait:
            for p in [*self._procs, *(w.process for w in self._replaced)]:
                p.join(timeout=5.0)
        self._inbox.close(wait)
        for worker in [*self._workers, *self._replaced]:
            worker.close()
        if wait:  # no recovery follows: the store's port and thread go now, not with this object
            self.__dict__.pop("_store", None)

    # -- surviving a failure (``survive``) --------------------------------------------------
    @property
    def _with_others(self) -> str:
        return "" if self.survive else " with the other workers"

    def _fail(self, rank: int | None) -> None:
        """A failure's first act: kill every worker, or with ``survive`` only the failed one
        (its peers' collectives with it then end in errors, and they wait for ``regroup``)."""
        if self.survive and rank is not None:
            self._workers[rank].kill(self._groups_killed)
        else:
            self.kill(wait=False)

    def regroup(self, failed: int) -> None:
        """Replace worker ``failed`` (and any other that has ended or is stopped) with a spare,
        keep the other workers' processes, and form a new process group of them all; each
        builds a new replica, to be begun from a restore point (``training.regroup``).
        Raises WorkerError when that cannot be done within ``REGROUP_S`` (or without
        ``survive``): the caller then starts new workers."""
        if not self.survive or self._killed:
            raise WorkerError("this pool cannot regroup (its workers were killed, or its "
                              "collectives are not gloo's)")
        try:
            self._regroup(failed)
        except Exception as e:  # the caller starts new workers
            self.kill(wait=False)
            if isinstance(e, WorkerError):
                raise
            # A spare that cannot start, a reply that cannot be read.
            raise WorkerError(f"the process group could not be formed again: "
                              f"{type(e).__name__}: {e}") from e
        replaced, self._replaced = self._replaced, []
        for worker in replaced:  # dead by now: reaped, their queues closed
            worker.process.join(timeout=1.0)
            worker.close()

    def _regroup(self, failed: int) -> None:
        deadline = time.monotonic() + min(self.timeout_s, REGROUP_S)
        try:  # the survivors skip the rounds queued for the old group
            self._gate.halt(-1, timeout_s=1.0)
        except TimeoutError as e:
            raise WorkerError(f"the process group could not be formed again: {e}") from e
        for rank in lost_ranks(self._procs, failed):
            # Its queues are closed once the group has formed again (the inbox may read one).
            self._workers[rank].kill(self._groups_killed)
            self._replaced.append(self._workers[rank])
            self._beats[rank] = 0.0  # the spare's heartbeats, from its first
            spare = self._workers[rank] = self._spares.take()
            self._procs[rank], self._tasks[rank] = spare.process, spare.tasks
        self._inbox.watch([p.sentinel for p in self._procs], [w.results for w in self._workers])
        self.generation += 1
        check = functools.partial(self._regrouping, deadline)
        send_regroup(self._tasks, self.generation, check)
        await_joined(self._inbox, self.workers, self.generation, check)
        self._pending.clear()
        self._outstanding = [0] * self.workers
        self._since = [time.monotonic()] * self.workers

    def _regrouping(self, deadline: float) -> None:
        """Raise WorkerError if a worker ended, or the time is up, before the group formed."""
        ended = [rank for rank, p in enumerate(self._procs) if p.exitcode is not None
                 or process_state(p.pid) == "stopped"]  # a stopped one would never join
        if ended or time.monotonic() > deadline:
            why = f"worker {ended[0]} ended or is stopped" if ended else \
                f"the workers did not join within {min(self.timeout_s, REGROUP_S):g} s"
            raise WorkerError(f"the process group could not be formed again: {why}")
