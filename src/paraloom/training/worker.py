"""The entry point of a ParallelWrapper worker process: join the group, then serve messages.

A daemon thread writes a heartbeat (``time.monotonic()``, every ``HEARTBEAT_PERIOD_S``) into
this worker's slot of an array shared with the parent. It does not depend on the training
thread: a slow step keeps beating, a stopped, frozen or killed process does not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import gc
import multiprocessing
import os
import pickle
import queue
import signal
import threading
import time
import traceback
from collections.abc import MutableSequence
from dataclasses import dataclass
from multiprocessing.queues import Queue

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import TCPStore

from paraloom.training.gate import RoundGate
from paraloom.training.group import Membership
from paraloom.training.memory import keep_freed_memory
from paraloom.training.messages import (
    Failed,
    Finish,
    Pickled,
    Ready,
    Regroup,
    Reply,
    RoundBatch,
    RoundMessage,
    RoundsDone,
    StepDone,
    Stop,
    ToReplica,
)
from paraloom.training.runner import ReplicaRunner, WorkerSpec

__all__ = ["WorkerConfig", "worker_main", "HEARTBEAT_PERIOD_S"]

_POLL_S = 0.5
HEARTBEAT_PERIOD_S = 0.1


@dataclass(frozen=True)
class WorkerConfig:
    """Process-level settings of one worker."""

    rank: int
    world_size: int
    store_port: int
    backend: str
    device: str
    threads: int
    timeout_s: float
    parent_pid: int
    malloc: str = "keep"
    """``training.memory``: ``keep`` (freed blocks reused by the next step) or ``system``."""
    survive: bool = False
    """After a failed round, wait for a ``Regroup`` instead of exiting (the pool keeps the
    workers that did not fail)."""


def _next_message(tasks: Queue[ToReplica | Pickled], parent_pid: int,
                  started_ppid: int) -> ToReplica | Pickled:
    """Wait for the next message; exit if the parent process has gone. (A worker started by
    the forkserver is its child; the forkserver exits with the parent, so either check sees
    it.)"""
    while True:
        try:
            return tasks.get(timeout=_POLL_S)
        except queue.Empty:
            if os.getppid() != started_ppid or not _exists(parent_pid):
                raise SystemExit("paraloom worker: parent process exited") from None


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user: the pid was reused
        return False
    return True


class _Heartbeat:
    """A daemon thread writing ``time.monotonic()`` into slot ``rank`` of the shared array
    every ``HEARTBEAT_PERIOD_S``; a spare (rank -1) beats once a ``Regroup`` gives it a rank."""

    def __init__(self, beats: MutableSequence[float], rank: int) -> None:
        self.beats, self._rank = beats, rank
        self._ranked = threading.Event()
        """Set once the worker has a rank: a spare's thread sleeps until then (each timed
        wake-up costs about 0.1 ms of CPU on a VM)."""
        if rank >= 0:
            self._ranked.set()
        self.thread = threading.Thread(target=self._beat, name="paraloom-heartbeat",
                                       daemon=True)
        self.thread.start()

    @property
    def rank(self) -> int:
        return self._rank

    @rank.setter
    def rank(self, rank: int) -> None:
        self._rank = rank
        if rank >= 0:
            self._ranked.set()

    def _beat(self) -> None:
        while True:
            self._ranked.wait()
            if (rank := self._rank) >= 0:
                self.beats[rank] = time.monotonic()
            time.sleep(HEARTBEAT_PERIOD_S)


def _store(cfg: WorkerConfig) -> TCPStore | None:
    """A client of the parent's rendezvous store. Connected in tries of ``_POLL_S``, each
    checking that the parent lives: one killed while the pool started left its workers
    retrying for the whole ``timeout`` (10 minutes by default), holding the forkserver."""
    if cfg.world_size == 1:
        return None
    deadline = time.monotonic() + cfg.timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            store = TCPStore("127.0.0.1", cfg.store_port, is_master=False,
                             timeout=datetime.timedelta(seconds=max(0.1, min(_POLL_S, left))))
        except (RuntimeError, TimeoutError):  # torch's DistStoreError is a RuntimeError
            if not _exists(cfg.parent_pid):
                raise SystemExit("paraloom worker: parent process exited") from None
            if left <= _POLL_S:
                raise
            continue
        store.set_timeout(datetime.timedelta(seconds=cfg.timeout_s))
        return store


def _runner(cfg: WorkerConfig, spec: WorkerSpec, group: dist.ProcessGroup | None,
            gate: RoundGate | None) -> ReplicaRunner:
    """This worker's replica, telling the gate when each step's own work is done."""
    runner = ReplicaRunner(spec, rank=cfg.rank, world_size=cfg.world_size, device=cfg.device,
                           group=group, shared_outbox=True)
    if gate is not None:
        runner.replica.loss_computed = functools.partial(gate.computed, cfg.rank)
        runner.batch_taken = functools.partial(gate.fetched, cfg.rank)
    return runner


def _report(results: Queue[Reply], failure: Failed) -> None:
    """Send the failure, and see it out before the process group is torn down: that can wait
    on the peers holding the GIL, which would stall the queue's feeder thread (and the
    heartbeat) meanwhile."""
    results.put(failure)
    if hasattr(results, "join_thread"):  # a multiprocessing queue (tests pass others)
        results.close()
        results.join_thread()


def _failure(rank: int, loop: _Loop | None, e: BaseException) -> Failed:
    return Failed(rank, None if loop is None else loop.round_id, f"{type(e).__name__}: {e}",
                  traceback.format_exc(), type(e).__name__)


def worker_main(cfg: WorkerConfig, spec_bytes: bytes, tasks: Queue[ToReplica | Pickled],
                results: Queue[Reply], beats: MutableSequence[float],
                gate_array: object = None) -> None:
    """Entry point of a worker process (``gate_array``: the pool's RoundGate). A spare
    (``cfg.rank`` -1) prepares its replica's setup and waits for a ``Regroup``."""
    started_ppid = os.getppid()
    if multiprocessing.parent_process() is not None:  # a worker process (not a test's call)
        # Ctrl-C reaches the whole process group: the parent decides when workers stop.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        # A group of its own, which its DataLoader's processes join: the pool kills the group,
        # so none of them outlives a worker that failed (killed, hung, or ended by SIGKILL).
        with contextlib.suppress(OSError):
            os.setpgid(0, 0)
        # What the forkserver imported lives as long as the process: out of the collector's
        # sight, a full collection (when a replica is replaced, see ``_Member.join``) takes
        # milliseconds instead of the 0.3 s it takes to walk torch's objects.
        gc.freeze()
    # The parent still treats this process as a daemon (ended when it exits); in here the flag
    # would forbid the loader worker processes of a DataLoader the replica runs itself.
    multiprocessing.current_process().daemon = False
    gate = RoundGate(gate_array) if gate_array is not None else None
    heartbeat = _Heartbeat(beats, cfg.rank)
    member = _Member(cfg, spec_bytes, gate, heartbeat)
    try:
        if cfg.malloc == "keep":
            keep_freed_memory()
        torch.set_num_threads(cfg.threads)
        if cfg.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(cfg.device))
        member.prepare()
        if cfg.rank >= 0:
            results.put(member.join(Regroup(0, cfg.rank)))
        while not isinstance(message := _next_message(tasks, cfg.parent_pid, started_ppid),
                                                Stop):
            member.serve(message, results)
    except BaseException as e:  # reported to the parent, which raises WorkerError
        if member.cfg.rank >= 0:  # a spare that ends is seen ended when it is wanted
            _report(results, _failure(member.cfg.rank, member.loop, e))
    finally:
        member.membership.leave()


class _Member:
    """A worker's place in the group: its replica, and (``cfg.survive``) what it does when a
    peer fails: report, leave the group, drop what is queued, and rejoin at ``Regroup``."""

    def __init__(self, cfg: WorkerConfig, spec_bytes: bytes, gate: RoundGate | None,
                 heartbeat: _Heartbeat) -> None:
        self.cfg, self.spec_bytes, self.gate, self.heartbeat = cfg, spec_bytes, gate, heartbeat
        self.store: TCPStore | None = None
        self.spec: WorkerSpec | None = None
        """Unpickled ahead (a spare's, or none yet): the next replica is built from it."""
        self.loop: _Loop | None = None
        """The replica's loop; None before the first ``Regroup`` (a spare) and after a round
        failed here: what is queued until the next ``Regroup`` is dropped."""
        self.membership = Membership()

    def prepare(self) -> None:
        """Connect to the rendezvous and unpickle the setup (a spare does it ahead)."""
        self.store = _store(self.cfg)
        self.spec = pickle.loads(self.spec_bytes)

    def join(self, regroup: Regroup) -> Ready:
        """Join group ``regroup.generation`` as ``regroup.rank`` with a new replica."""
        self._drop_replica()
        self.cfg = dataclasses.replace(self.cfg, rank=regroup.rank)
        self.heartbeat.rank = regroup.rank
        spec = self.spec if self.spec is not None else pickle.loads(self.spec_bytes)
        self.spec = None
        group = None if self.store is None else self.membership.join(
            self.store, regroup.rank, self.cfg.world_size, self.cfg.backend, self.cfg.timeout_s,
            regroup.generation)
        self.loop = _Loop(regroup.rank, _runner(self.cfg, spec, group, self.gate), self.gate)
        return Ready(regroup.rank, regroup.generation)

    def serve(self, message: ToReplica | Pickled, results: Queue[Reply]) -> None:
        if isinstance(message, Regroup):
            results.put(self.join(message))
        elif self.loop is None:
            if isinstance(message, Pickled):  # its shared memory, taken and let go
                with contextlib.suppress(Exception):
                    message.unpack()
        elif not self.cfg.survive:
            self.loop.serve(message, results)
        else:
            try:
                self.loop.serve(message, results)
            except Exception as e:  # the pool replaces the failed worker; this one waits
                results.put(_failure(self.cfg.rank, self.loop, e))
                e.__traceback__ = None  # its frames hold the replica
                self._drop_replica()

    def _drop_replica(self) -> None:
        """Leave the group and let the replica go (its memory, before a new one is built)."""
        self.membership.leave()
        if self.loop is not None:
            self.loop = None
            gc.collect()  # the replica's cycles


class _Loop:
    """One worker's handling of its messages, with the round in progress (for a failure's
    report) and the time each round took, its reply's sending included."""

    def __init__(self, rank: int, runner: ReplicaRunner, gate: RoundGate | None) -> None:
        self.rank, self.runner, self.gate = rank, runner, gate
        self.round_id: int | None = None
        """The round being trained (None outside rounds): a failure names it."""

    def serve(self, message: ToReplica | Pickled, results: Queue[Reply]) -> None:
        """Handle one message and send its reply (if it has one)."""
        began = time.perf_counter()
        timing = self.runner.replica.timing
        counted = timing.round_s
        if isinstance(message, Pickled):
            # The round is known before unpickling, so a batch that fails to load is reported
            # on its own round.
            self.round_id = message.round_id if message.round_id is not None else self.round_id
            message = message.unpack()
        reply = self._handle(message)
        if reply is not None:
            results.put(reply)
        if isinstance(reply, StepDone | RoundsDone):  # the whole span: unpickling and sending too
            timing.round_s = counted + time.perf_counter() - began

    def _handle(self, message: ToReplica) -> Reply | None:
        if isinstance(message, RoundBatch):
            return RoundsDone(tuple(self._round(r) for r in message.rounds))
        if isinstance(message, RoundMessage):
            return self._round(message)
        if isinstance(message, Finish):
            self.round_id = None
        return self.runner.handle(message)

    def _round(self, message: RoundMessage) -> StepDone:
        """Train one round, unless stop() halted the fit before it (the gate says so)."""
        if self.gate is not None and not self.gate.admit(self.rank, message.round_id):
            return StepDone(self.rank, message.round_id, None, 0, False, skipped=True)
        self.round_id = message.round_id
        done = self.runner.handle(message)
        if not isinstance(done, StepDone):
            raise TypeError(f"a round was answered with {type(done).__name__}; expected "
                            f"StepDone")
        return done
