"""RecoveringPool: a Pool that survives worker failures by restarting from a restore point.

Every 0.1 s or more (at most ~2% of the time: see ``_interval``) or every ``_MAX_LOGGED_ROUNDS``
rounds, it asks every replica for its full state right after a round has been dealt: a restore
point. At the end of each fit() it takes one more, the *carry-over*: what replicas keep from
one fit() to the next on a reused pool (residuals, a factory-built optimizer's state), which
a restart before the next fit's first restore point begins from, before that fit's ``Begin``.
When a worker fails (killed, stopped, hung, raised, exited), a pool that can (``regroup``:
gloo, on CPUs) kills only that worker, gives its rank to a spare process and forms the process
group again with the survivors' processes (``training.regroup``); otherwise it kills every
worker and takes a spare pool started ahead (``training.spares``; or starts a fresh one: new
processes, a new process group on a new port). Either way every replica begins from the
restore point, and every message sent since is sent again. Replies already delivered are not
delivered twice, so the caller sees each round once: no batch is lost, none is trained twice,
and the result is the one an uninterrupted run with the same seed and data order would give.

Why the survivors begin from the restore point too, not from their own state: a survivor is
usually part way through a round when its peer fails (in a collective with it, its BatchNorm
statistics and RNG moved, in ``allreduce`` its gradients half reduced); on one machine the
parent holds a consistent state of every replica at little cost instead.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeGuard, TypeVar

from paraloom._warnings import warn
from paraloom.errors import WorkerError
from paraloom.training.messages import (
    Answer,
    Begin,
    CheckpointReply,
    Finished,
    LoaderEpoch,
    RestorePoint,
    RestorePointRequest,
    RoundBatch,
    RoundMessage,
    StepDone,
    ToReplica,
)
from paraloom.training.packing import RESTORE_BUFFERS, PackedTensors, ReceivedBuffers
from paraloom.training.pool import Pool, RegroupingPool
from paraloom.training.spares import Spares

__all__ = ["RecoveringPool", "Recovery", "warn_lost_between_fits", "without_frames"]

log = logging.getLogger("paraloom")

_T = TypeVar("_T")
_MIN_INTERVAL_S = 0.1
_MAX_LOGGED_ROUNDS = 64  # batches in the log hold shared memory (and file descriptors)
_CARRY_OVER = -1  # the round id of the restore point taken at the end of a fit
_COST_SHARE = 0.02  # restore points may take up to this share of the training time
_COSTS_KEPT = 9
"""The interval follows the median of the last few restore points' costs: one slow copy (the
first, into fresh pages, or one taken while the machine was busy) does not space all the
later ones out."""
_MAX_PENDING = RESTORE_BUFFERS - 2  # and the carry-over, asked for at the end of a fit
"""Restore points asked for at once: one is answered behind the rounds in flight (about two
messages' worth), so with one at a time they came every two messages, and a failure replayed
up to twice as much. Fewer than the buffers a worker packs them into (see ``_keep``)."""


@dataclass(frozen=True)
class Recovery:
    """One survived failure: who failed, why, and what it cost."""

    rank: int | None
    error: WorkerError
    detected_at: float
    """``time.monotonic()`` when the failure was detected (the clock is shared by processes)."""
    restart_seconds: float
    """From the failure's detection until the new workers had begun from the restore point
    (the replay then runs as training does)."""
    replayed_rounds: int
    """Rounds sent again: those dealt after the restore point."""
    detect_seconds: float = 0.0
    """For a frozen or hung worker, how long it had been silent when found (its heartbeat's
    or its replies' gap, ``WorkerError.silent_seconds``): time the fit waited for it. A worker
    that died is found at once (0)."""
    redone_rounds: int = 0
    """Of the ``replayed_rounds``, those a worker had answered before the failure: training
    done again (the others had been dealt ahead and not yet trained)."""


@dataclass
class _Restore:
    round_id: int | None
    """The last round the restore point includes; None: the start of the fit (nothing kept);
    ``_CARRY_OVER``: the end of the last fit."""
    states: list[PackedTensors | None]
    log_index: int
    """Where in the message log the restore point was asked for."""
    seconds: float = 0.0
    """The longest any replica took to copy its state so far."""


class RecoveringPool:
    """Wraps pools made by ``start``; survives up to ``max_failures`` failures per fit()."""

    def __init__(self, start: Callable[[], Pool], max_failures: int,
                 on_recovery: Callable[[Recovery], None], spares: int = 0,
                 spare_wait_s: float = 120.0) -> None:
        self._start = start
        self.max_failures = max_failures
        self._on_recovery = on_recovery
        self._pool = start()
        # A pool that regroups keeps spare workers of its own; whole spare pools are for one
        # that cannot (its workers are all replaced).
        self._spares = Spares(start, 0 if _regroups(self._pool) else spares)
        self._spare_wait_s = spare_wait_s
        self.workers = self._pool.workers
        self.backend, self.devices, self.threads = \
            self._pool.backend, self._pool.devices, self._pool.threads
        self.failures = 0
        self._begins: list[Begin] = []
        self._log: list[tuple[int, ToReplica]] = []
        self._restore = _Restore(None, [], 0)
        self._pending: deque[_Restore] = deque()
        """Restore points asked for and not yet complete, oldest first."""
        self._last_request = time.monotonic()
        self._costs: deque[float] = deque(maxlen=_COSTS_KEPT)
        self._delivered: set[tuple[str, int, int]] = set()
        self._begun_at: float | None = None
        self._carry: list[PackedTensors | None] | None = None
        """Each replica's state at the end of the last fit(), on this pool's workers."""
        self._finished: set[int] = set()
        self._halted: int | None = None
        self._first_round: int | None = None
        """The fit's first round: no restore point right after it (DDP has not yet settled
        its buckets, see ``sync.ddp_buckets``; a replica restored there would differ)."""
        self._retired: list[Pool] = []
        """Pools that failed, killed but not yet reaped."""
        self._received = ReceivedBuffers()
        """The workers' restore-point buffers, mapped here once."""

    @property
    def pids(self) -> list[int]:
        return self._pool.pids

    @property
    def alive(self) -> bool:
        return self._pool.alive

    @property
    def warm(self) -> bool:
        """A restart before the next fit's first restore point needs the carry-over."""
        return self._carry is not None

    # -- the Pool protocol ------------------------------------------------------------------
    def begin(self, messages: Sequence[Begin]) -> None:
        self.failures = 0
        self._begins = list(messages)
        self._log = []
        self._restore = _Restore(None, [], 0)
        self._pending.clear()
        self._delivered = set()
        self._finished = set()
        self._halted = None
        self._first_round = None
        self._last_request = time.monotonic()
        self._sent(lambda: self._pool.begin(self._begins))

    def send(self, rank: int, message: ToReplica) -> None:
        self._log.append((rank, message))
        self._sent(lambda: self._pool.send(rank, message))
        if rank == self.workers - 1 and isinstance(message, RoundMessage | RoundBatch):
            if self._first_round is None:
                self._first_round = message.round_id
            if message.round_id != self._first_round:
                self._maybe_request(message.round_id)

    def halt(self, last: int | None = None) -> int:
        self._halted = self._guarded(lambda: self._pool.halt(last))
        return self._halted

    def recv(self, timeout_s: float | None = None) -> Answer | None:
        while True:
            reply = self._guarded(lambda: self._pool.recv(timeout_s))
            if reply is None:
                return None
            if isinstance(reply, RestorePoint):
                self._keep(reply)
                continue
            key = _key(reply)
            if key in self._delivered:
                continue  # a round replayed after a recovery: the caller has it already
            self._delivered.add(key)
            if isinstance(reply, Finished):
                self._finished.add(reply.rank)
                if len(self._finished) == self.workers:
                    self._take_carry_over()
            return reply

    def _take_carry_over(self) -> None:
        """Every replica's state between this fit and the next, while all are idle and alive."""
        self._carry = None
        self._request(_CARRY_OVER)
        while any(p.round_id == _CARRY_OVER for p in self._pending):
            reply = self._guarded(lambda: self._pool.recv(None))
            if isinstance(reply, RestorePoint):
                self._keep(reply)
        if self._restore.round_id == _CARRY_OVER:  # copied: kept for the whole next fit
            self._carry = [None if s is None else s.private() for s in self._restore.states]

    def revive(self) -> bool:
        """After workers were lost between fits (killed, stopped): new ones that begin from
        the carry-over, as the lost ones would have gone on; not a failure, nothing was
        training. False without a carry-over (then nothing is kept to begin from)."""
        if self._carry is None:
            return False
        self._replace_pool()
        self._begin_carry_over(self._carry)
        self._reap()
        return True

    def _replace_pool(self) -> None:
        """Kill the pool (reaped later) and take a spare pool, or start a new one."""
        self._pool.kill(wait=False)
        self._retired.append(self._pool)
        spare = self._spares.take(self._spare_wait_s) if self._spares.count else None
        self._pool = spare if spare is not None else self._start()

    def _begin_carry_over(self, carry: list[PackedTensors | None]) -> None:
        """As the lost workers did: begin each replica from what it carried from the last
        fit (the fit's own ``Begin`` follows)."""
        self._pool.begin([Begin(None, resume=carry[rank]) for rank in range(self.workers)])

    def close(self, timeout_s: float = 10.0) -> None:
        self._spares.close(timeout_s)
        self._pool.close(timeout_s)
        self._reap()

    def kill(self, wait: bool = True) -> None:
        self._spares.kill()
        self._pool.kill(wait)
        if wait:
            self._reap()

    def _reap(self) -> None:
        """Reap the pools that failures replaced (killed without waiting, to recover sooner)."""
        retired, self._retired = self._retired, []
        for pool in retired:
            pool.kill()

    @property
    def spare_pids(self) -> list[int]:
        """Process ids of the spare workers that are ready (``spares=``)."""
        own = self._pool.spare_pids if isinstance(self._pool, RegroupingPool) else []
        return self._spares.pids + own

    # -- restore points -----------------------------------------------------------------------
    def _interval(self) -> float:
        """Seconds between restore points: taking one costs ``_COST_SHARE`` of the time."""
        cost = statistics.median(self._costs) if self._costs else 0.0
        return max(_MIN_INTERVAL_S, cost / _COST_SHARE)

    def _maybe_request(self, round_id: int) -> None:
        if len(self._pending) >= _MAX_PENDING:
            return
        logged = sum(len(m.rounds) if isinstance(m, RoundBatch) else 1
                     for _, m in self._log) // self.workers
        if time.monotonic() - self._last_request >= self._interval() \
                or logged >= _MAX_LOGGED_ROUNDS:
            self._request(round_id)

    def _request(self, round_id: int) -> None:
        self._last_request = time.monotonic()
        self._pending.append(_Restore(round_id, [None] * self.workers, len(self._log)))
        self._sent(lambda: self._request_all(RestorePointRequest(round_id)))

    def _request_all(self, request: RestorePointRequest) -> None:
        for rank in range(self.workers):
            self._pool.send(rank, request)

    def _keep(self, reply: RestorePoint) -> None:
        # A view of the worker's buffer, not a copy: the worker packs its restore points into
        # RESTORE_BUFFERS buffers in turn, and at most _MAX_PENDING + 1 (the carry-over) are
        # asked for after the restore point held, so its buffer is not written again while
        # it is held; a dead worker's buffers stay mapped here.
        state = self._received.view(reply.rank, reply.state)
        pending = next((p for p in self._pending if p.round_id == reply.round_id), None)
        if pending is None:
            return  # asked for before a recovery: that pool is gone
        pending.states[reply.rank] = state
        pending.seconds = max(pending.seconds, reply.seconds)
        if any(s is None for s in pending.states):
            return
        # Every worker answers in order, so an older request is complete before this one.
        while self._pending.popleft() is not pending:
            pass
        self._costs.append(pending.seconds)  # the slowest replica's copy
        self._restore = pending
        # A worker's LoaderEpoch stays: the rounds after the restore point load from its plan.
        epochs = {rank: (rank, m) for rank, m in self._log[:pending.log_index]
                  if isinstance(m, LoaderEpoch)}
        self._log[:pending.log_index] = list(epochs.values())
        for later in self._pending:  # where the log now holds what they were asked after
            later.log_index += len(epochs) - pending.log_index
        pending.log_index = 0
        self._delivered = {k for k in self._delivered if k[0] != "step" or k[1] > reply.round_id}

    # -- failures -----------------------------------------------------------------------------
    def _guarded(self, call: Callable[[], _T]) -> _T:
        """``call()``; after a failure, recover and call it again (on the new workers)."""
        while True:
            try:
                return call()
            except WorkerError as e:
                self._recover(e)

    def _sent(self, send: Callable[[], None]) -> None:
        """``send()``; after a failure, recover: what it sent is in the log, replayed then."""
        try:
            send()
        except WorkerError as e:
            self._recover(e)

    def _recover(self, error: WorkerError) -> None:
        """Start new workers from the restore point and send them every message since."""
        while True:
            if self.failures >= self.max_failures:
                raise error
            self.failures += 1
            started = time.monotonic()
            log.warning("paraloom: %s; recovering (failure %d of at most %d)",
                        str(error).splitlines()[0], self.failures, self.max_failures)
            self._reap()  # the pools of earlier failures: long dead, reaped at no wait
            rounds = {r.round_id for _, m in self._log
                      for r in (m.rounds if isinstance(m, RoundBatch) else (m,))
                      if isinstance(r, RoundMessage)}
            answered = {key[1] for key in self._delivered if key[0] == "step"}
            again = None
            self._begun_at = None
            try:
                self._restart(error)
            except WorkerError as e:  # the new workers failed too: that is another failure
                again = e
            begun = self._begun_at or time.monotonic()
            self._on_recovery(Recovery(error.worker, without_frames(error), started,
                                       begun - started, len(rounds),
                                       error.silent_seconds or 0.0, len(rounds & answered)))
            if again is None:
                return
            error = again

    def _restart(self, error: WorkerError) -> None:
        self._pending.clear()
        self._received.clear()
        if not self._regrouped(error):
            self._replace_pool()
        restore = self._restore
        if restore.round_id is None and self._carry is not None:
            self._begin_carry_over(self._carry)
        # The restore point holds the model and optimizer state: the fit's own are left out
        # (each tensor of a message costs a shared-memory segment and a descriptor).
        begins = self._begins if restore.round_id in (None, _CARRY_OVER) else [
            dataclasses.replace(b, state=None, optimizer_state=None, resume=restore.states[rank])
            for rank, b in enumerate(self._begins)]
        self._pool.begin(begins)
        if self._halted is not None:  # replay no round that stop() cut off
            self._pool.halt(self._halted)
        self._begun_at = time.monotonic()
        for rank, message in self._log:
            self._pool.send(rank, message)

    def _regrouped(self, error: WorkerError) -> bool:
        """Whether the pool replaced the failed worker and kept the others (``regroup``)."""
        if not _regroups(self._pool) or error.worker is None:
            return False
        try:
            self._pool.regroup(error.worker)
        except WorkerError as e:
            log.warning("paraloom: %s; starting new workers", e)
            return False
        return True


def _regroups(pool: Pool) -> TypeGuard[RegroupingPool]:
    return isinstance(pool, RegroupingPool) and pool.survive


def _key(reply: StepDone | CheckpointReply | Finished) -> tuple[str, int, int]:
    match reply:
        case StepDone():
            return "step", reply.round_id, reply.rank
        case CheckpointReply():
            return "checkpoint", reply.tag, reply.rank
        case Finished():
            return "finished", 0, reply.rank


def warn_lost_between_fits() -> None:
    """Workers lost between fits with no carry-over to begin from (``max_failures=0``, or a
    last fit that failed): say what starts again."""
    warn("a worker stopped between fits (killed, or silent past its heartbeat); this fit "
         "starts new workers from your model and optimizer, so what only the workers kept, "
         "if anything, starts again: the state of an optimizer built by a factory, each "
         "replica's own optimizer state in averaging, the residuals of shared gradients and "
         "DiLoCo, DiLoCo's outer optimizer. With max_failures >= 1 the workers' state at the "
         "end of each fit is kept, and new workers begin from it")


def without_frames(error: WorkerError) -> WorkerError:
    """``error`` and every exception it was raised from or during (``__cause__``,
    ``__context__``) without their tracebacks: a recovery keeps the error, and the frames of
    the pool that raised it (a ``queue.Empty`` caught while the workers were checked) would
    keep the dead pool, its queues and their semaphores, alive for as long as the wrapper."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        e = pending.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        e.__traceback__ = None
        pending += [e.__cause__, e.__context__]
    return error
