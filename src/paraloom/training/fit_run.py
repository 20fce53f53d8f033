"""FitRun: one ``fit()`` of a ParallelWrapper, from the first message to rank 0's result.

The wrapper holds what lasts between fits (the workers, the mirror of what they hold, the
checkpoint collector); a FitRun holds what lasts one fit: where it starts, what it sent, the
rounds dealt, ``stop()``, and the warnings given once per fit. It deals each epoch's rounds
(``dealing``), handles the workers' replies as they come (the ``RoundTracker`` fires the
listeners and the progress bar in round order), asks for checkpoints between rounds, and at
the end collects every replica's ``Finished``.
"""

from __future__ import annotations

import copy
import functools
import logging
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from paraloom._warnings import warn
from paraloom.data import IndexedDataset, cpu_copy, indexed_view, split_batch
from paraloom.errors import NotPicklableError, WorkerError
from paraloom.listeners import TrainingListener
from paraloom.training.buffers import with_transient
from paraloom.training.dealing import (
    Source,
    batch_rounds,
    check_dealt,
    data_generators,
    data_rng,
    loader_rounds,
    round_message,
    set_data_rng,
    set_sampler_epoch,
    total_batches,
    yields_samples,
)
from paraloom.training.layout import Layout
from paraloom.training.loaders import LoaderSpec, loader_spec
from paraloom.training.messages import (
    Answer,
    Begin,
    CheckpointReply,
    EndAccumulation,
    Finish,
    Finished,
    Hyperparameters,
    IdleRound,
    LoaderEpoch,
    LoaderRound,
    ReplicaResult,
    StepDone,
)
from paraloom.training.mirror import ReplicaMirror, changed_settings, hyperparameters
from paraloom.training.options import LoopOptions
from paraloom.training.pacing import RECOVERING_TARGET_S, TARGET_S, Pacing, PendingRounds
from paraloom.training.pool import Pool
from paraloom.training.resume import CheckpointCollector, Start
from paraloom.training.tracker import RoundTracker

__all__ = ["FitPlan", "FitRun", "Sent", "Start"]

log = logging.getLogger("paraloom")


@dataclass(frozen=True)
class FitPlan:
    """What one fit() trains and with whom: fixed for the fit."""

    data: Any
    """The data source, as ``as_data_source`` left it."""
    epochs: int
    start: Start
    workers: int
    loop: LoopOptions
    batches_are_pairs: bool
    """Each batch must be an ``(inputs, targets)`` pair (no ``step_fn`` was given)."""
    accumulate: int = 1
    """Rounds per optimizer step (``StepOptions.accumulate``): an epoch's end then steps."""
    recovering: bool = False
    """Whether the pool survives failures (``max_failures > 0``): shorter messages then."""


@dataclass(frozen=True)
class Sent:
    """What a fit's first message sent: the model's state, the optimizer's state."""

    model: bool
    optimizer: bool


@dataclass
class _Dealt:
    """Rounds dealt in this fit() so far, and the iteration the fit began at."""

    base: int
    round_id: int = 0


class FitRun:
    """One fit(): deals its rounds to ``pool`` and handles the replies until rank 0's result."""

    def __init__(self, plan: FitPlan, pool: Pool, tracker: RoundTracker,
                 checkpoints: CheckpointCollector, listeners: list[TrainingListener],
                 optimizer: torch.optim.Optimizer | None, layout: Layout | None = None
                 ) -> None:
        self.plan, self.pool, self.tracker = plan, pool, tracker
        self.checkpoints, self.listeners, self.optimizer = checkpoints, listeners, optimizer
        self.stop_requested = False
        """Set by ``ParallelWrapper.stop()``: no round is dealt after the one in flight."""
        self.layout = layout
        """The layout the workers were built with (None: not checked during the fit)."""
        self.relaid: tuple[int, str] | None = None
        """The epoch the fit stopped at because a listener changed the layout, and what."""
        self._model: nn.Module | None = None
        self.sent = Sent(model=True, optimizer=True)
        """What the first message sent (``stats()``'s ``model_sent`` and the like)."""
        self.settings_sent: list[dict[str, Any]] = []
        """The optimizer's settings as the replicas last took them (``hyperparameters``)."""
        self._halted = False
        """Whether stop() was passed on to the workers (``_halt_if_stopped``)."""
        self._dealt = _Dealt(base=tracker.iteration)
        self._next_epoch_rng: torch.Tensor | None = None
        self._epoch_end: Callable[..., None] | None = None
        """The last epoch's end checkpoint request (``CheckpointCollector.request``), to call
        with ``renew=``."""
        self.pacing = Pacing(target_s=RECOVERING_TARGET_S if plan.recovering else TARGET_S)
        """Rounds per message, from the rounds' length (``training.pacing``)."""
        self._cpu_began = time.process_time()
        self._one_row_each = yields_samples(plan.data)
        self.parent_cpu_s = 0.0
        """CPU seconds this process (all its threads) spent while the rounds ran: dealing,
        messaging, listeners. A fixed cost per round, taken from the workers' cores."""
        self._warned_unsharded = False
        self._warned_settings = False

    def stop(self) -> None:
        """Stop after the round in flight; the rounds queued behind it are not trained."""
        self.stop_requested = True

    # -- the first message ---------------------------------------------------------------------
    def begin(self, model: nn.Module, mirror: ReplicaMirror | None) -> Source:
        """Start the fit on every worker; returns what the workers load themselves: the loader
        each runs, or the dataset dealt by index (None: batches go through this process).

        The user's model and optimizer are the reference copies: their current state goes out
        (a learning rate changed between fits applies), and the workers' RNGs are seeded from
        the caller's, so ``torch.manual_seed`` makes dropout reproducible too. On a warm pool
        the model and the optimizer state go out only if they changed since the last fit()
        (``mirror``); the optimizer's hyperparameters always do.
        """
        data, start, opt = self.plan.data, self.plan.start, self.optimizer
        self._model = model
        loader = loader_spec(data)
        indexed = indexed_view(data) if loader is None else None
        if mirror is not None and not (mirror.pool is self.pool and self.pool.warm
                                       and start.replicas is None):
            mirror = None
        send_model = mirror is None or not mirror.model_unchanged(model)
        send_opt = opt is not None and (mirror is None or not mirror.optimizer_unchanged(opt))
        self.sent = Sent(model=send_model, optimizer=send_opt)
        # Copies: never share the user's tensors with the workers.
        opt_state = copy.deepcopy(opt.state_dict()) if opt is not None and send_opt else None
        settings = hyperparameters(opt) if opt is not None and not send_opt else None
        self.settings_sent = hyperparameters(opt) if opt is not None else []
        if opt is not None:
            # The replicas step copies of it: torch's schedulers check this flag to warn of a
            # scheduler.step() before any optimizer.step(), which a listener's step is not.
            setattr(opt, "_opt_called", True)  # noqa: B010
        # One worker runs in this process on the caller's RNG: drawing a seed would move it,
        # and a dropout model would then differ from the same PyTorch loop.
        seed = None if self.plan.workers == 1 else int(torch.randint(0, 2**62, ()).item())
        state = cpu_copy(with_transient(model, model.state_dict())) if send_model else None
        continue_schedule = start.epoch > 0 and start.replicas is None  # initial_epoch=

        replicas, self._next_epoch_rng = start.taking_shared_rng(
            self.plan.workers, total_batches(data, 1))

        def messages(dataset: IndexedDataset | None) -> list[Begin]:
            return [Begin(state, dataset, replicas[rank] if replicas else None,
                          opt_state, seed, loader, settings, continue_schedule)
                    for rank in range(self.plan.workers)]

        try:
            self.pool.begin(messages(indexed))
        except NotPicklableError as e:  # e.g. a dataset holding a lock: stream it instead
            if loader is not None:
                raise NotPicklableError(
                    f"{e}. Each worker runs its own DataLoader over this "
                    f"{type(loader.dataset).__name__}, so it must be picklable: define it at "
                    "module level and open files or connections lazily in __getitem__ / "
                    "__iter__; or pass a generator of batches, which this process reads") from e
            if indexed is None:
                raise
            log.info("%s; its batches go through the parent process instead", e)
            indexed = None
            self.pool.begin(messages(None))
        return loader or indexed

    # -- epochs --------------------------------------------------------------------------------
    def deal(self, source: Source) -> None:
        """Deal every epoch from the start position on, or until ``stop()``."""
        self._cpu_began = time.process_time()
        start = self.plan.start
        per_epoch = total_batches(self.plan.data, 1)
        for epoch in range(start.epoch, self.plan.epochs):
            if epoch > start.epoch:
                self._between_epochs()
            skip = start.batch if epoch == start.epoch else 0
            # A checkpoint written at an epoch's end: its listeners saw all of it already
            # (the epoch is still gone through, dealing nothing, for the data RNG it draws).
            finished = epoch == start.epoch and start.epoch_done(per_epoch)
            if not self.stop_requested and not finished:
                self.tracker.start_epoch(epoch)
            self._stop_if_relaid(epoch)
            if self.stop_requested:
                self._halt_if_stopped()
                return
            # What the epoch's listeners changed (a scheduler's step) applies from its first
            # round on: every earlier round is done, none of this epoch's is dealt. The last
            # epoch's end checkpoint is taken again with them, as a loop of one's own saves
            # after scheduler.step(): a resume trains this epoch at its own rate too.
            if self._send_settings() and self._epoch_end is not None:
                self._epoch_end(renew=True)
            set_sampler_epoch(self.plan.data, epoch)
            generators = data_generators(self.plan.data)
            if epoch == start.epoch and start.data_rng is not None:
                set_data_rng(start.data_rng, generators)  # the interrupted epoch's order
            epoch_rng = data_rng(generators)
            stream = isinstance(source, LoaderSpec) and source.stream
            if isinstance(source, LoaderSpec) and source.stream:
                dealt = self._deal_stream(source, epoch, skip, epoch_rng)
            else:
                dealt = self._deal_epoch(source, epoch, skip, epoch_rng)
            if self.stop_requested:
                self._halt_if_stopped()
                return
            check_dealt(dealt, epoch, first=epoch == start.epoch)
            if self.plan.accumulate > 1:  # the epoch's last rounds step, as in Lightning
                for rank in range(self.plan.workers):
                    self.pool.send(rank, EndAccumulation())
            if self._dealt.round_id:
                # Nothing has drawn from the data RNG since the epoch ended: its state now is
                # where the next epoch starts.
                following = data_rng(generators) if stream else None
                self._epoch_end = functools.partial(
                    self.checkpoints.request, self.pool,
                    self._dealt.base + self._dealt.round_id - 1, epoch, dealt, epoch_rng, True,
                    following)
                self._epoch_end(renew=self.plan.accumulate > 1)

    def _between_epochs(self) -> None:
        """The last epoch's rounds answered and its listeners called; then, where this process
        holds the replica's RNG, the state the next epoch draws from
        (``Start.taking_shared_rng``)."""
        self._await_rounds()
        self.tracker.end_epoch()
        if self._next_epoch_rng is not None:
            torch.set_rng_state(self._next_epoch_rng)
            self._next_epoch_rng = None

    def _deal_epoch(self, source: Source, epoch: int, skip: int,
                    epoch_rng: list[torch.Tensor]) -> int:
        """Deal one epoch whose batches are known up front, without waiting for replies
        (bounded by the rounds in flight), several rounds per message where steps are short
        (``pacing``); returns the batches dealt."""
        dealt, workers, pending = skip, self.plan.workers, PendingRounds(self.plan.workers)
        for payloads in self._rounds(source, epoch, skip):
            per_message = self._rounds_per_message(source)
            # Wait for replies rather than for room in a full queue: listeners (and the
            # progress bar) then run as each round finishes, not a round late.
            while self.tracker.in_flight >= max(self.plan.loop.queue_depth(workers),
                                                2 * per_message):
                pending.send(self.pool)  # the replies waited for may be of these rounds
                self._handle(self.pool.recv(timeout_s=None))
            round_id = self._dealt.round_id
            self.tracker.add(round_id, epoch, dealt, len(payloads))
            pending.add([round_message(source, round_id, epoch, payloads[rank])
                         if rank < len(payloads) else IdleRound(round_id)
                         for rank in range(workers)])
            dealt += len(payloads)
            iteration = self._dealt.base + round_id
            wanting = self.checkpoints.wanting(iteration, epoch, False)
            if len(pending) >= per_message or wanting:
                pending.send(self.pool)  # a checkpoint request follows its round
            self.checkpoints.request(self.pool, iteration, epoch, dealt, epoch_rng, False,
                                     wanting=wanting)
            self._dealt.round_id += 1
            self._drain(block=False)
            if self.stop_requested:
                break
        pending.send(self.pool)  # after stop(), the workers answer these as skipped
        return dealt

    def _rounds_per_message(self, source: Source) -> int:
        """Batches read by this process wait in shared memory while in flight: for them,
        no more rounds in flight than ``prefetch_buffer`` allows."""
        per_message = self.pacing.rounds_per_message
        if source is None:
            return min(per_message, max(1, self.plan.loop.queue_depth(self.plan.workers) // 2))
        return per_message

    def _rounds(self, source: Source, epoch: int, skip: int) -> Iterable[list[Any]]:
        plan = self.plan
        if isinstance(source, LoaderSpec):
            return loader_rounds(self.pool, plan.data, epoch, skip, plan.workers)
        # prefetch_buffer counts batches per worker, as DL4J's prefetchBuffer does.
        return batch_rounds(plan.data, source, plan.workers, skip,
                            plan.loop.prefetch_buffer * plan.workers, self._checked)

    def _deal_stream(self, source: LoaderSpec, epoch: int, skip: int,
                     epoch_rng: list[torch.Tensor]) -> int:
        """Deal one epoch of an IterableDataset that every worker iterates itself: a round
        goes out once the last is answered, to the workers whose stream goes on (the others
        take part idly) until every stream has ended. A checkpoint's ``batch`` counts
        ``workers`` per round, so a resumed worker skips ``batch // workers`` of its batches."""
        workers = self.plan.workers
        seed = int(torch.randint(0, 2**62, ()).item())
        for rank in range(workers):
            self.pool.send(rank, LoaderEpoch(epoch, seed))
        active, position, dealt, trained = list(range(workers)), skip // workers, skip, False
        seen: set[str] = set()
        while active:
            round_id = self._dealt.round_id
            self.tracker.add(round_id, epoch, dealt, len(active))
            for rank in range(workers):
                self.pool.send(rank, LoaderRound(round_id, epoch, position) if rank in active
                               else IdleRound(round_id))
            replies = self._await_round(round_id)
            active = [rank for rank in active if replies[rank].more]
            trained = trained or any(r.loss is not None for r in replies.values())
            self._check_sharded(source, replies.values(), seen)
            position, dealt = position + 1, dealt + workers
            self.checkpoints.request(self.pool, self._dealt.base + round_id, epoch, dealt,
                                     epoch_rng, False)
            self._dealt.round_id += 1
            if self.stop_requested:
                break
        return dealt if trained else skip

    # -- replies -------------------------------------------------------------------------------
    def _await_rounds(self) -> None:
        """Handle replies until every round dealt is done (its listeners called)."""
        while self.tracker.in_flight:
            self._handle(self.pool.recv(timeout_s=None))

    def _await_round(self, round_id: int) -> dict[int, StepDone]:
        """Handle replies until every worker has answered round ``round_id``."""
        got: dict[int, StepDone] = {}
        while len(got) < self.plan.workers:
            reply = self.pool.recv(timeout_s=None)
            self._handle(reply)
            if isinstance(reply, StepDone) and reply.round_id == round_id:
                got[reply.rank] = reply
        return got

    def _drain(self, block: bool) -> Finished | None:
        """Handle worker replies until none is waiting, or (``block``) until one finishes."""
        while True:
            reply = self.pool.recv(timeout_s=None if block else 0)
            if reply is None:
                return None
            if isinstance(reply, Finished):
                return reply
            self._handle(reply)

    def _handle(self, reply: Answer | None) -> None:
        """Account for a worker's reply to a round or a checkpoint request; then pass on a
        ``stop()`` that a listener it ran may have called."""
        match reply:
            case StepDone():
                rows = 1 if self._one_row_each and not reply.rows_agree else reply.rows
                completed = self.tracker.reply(reply.round_id, reply.loss, rows,
                                               reply.synced, reply.skipped)
                if completed:
                    self.pacing.completed(completed)
                    self._warn_if_settings_changed()  # listeners ran: did they change them?
            case CheckpointReply():
                self.checkpoints.receive(reply)
        self._halt_if_stopped()

    def salvage(self) -> None:
        """After a failure: hand the checkpoint replies that came in before it to the
        collector, so that a checkpoint every replica had answered is still written."""
        while True:
            try:
                reply = self.pool.recv(0)
            except WorkerError:  # nothing more to read: the workers are gone
                return
            if reply is None or isinstance(reply, Finished):
                return
            if isinstance(reply, CheckpointReply):
                try:
                    self.checkpoints.receive(reply)
                except Exception:  # the fit's own error is the one to raise
                    log.exception("paraloom: a checkpoint from before the failure was not "
                                  "written")

    def _halt_if_stopped(self) -> None:
        """After ``stop()``: every worker skips the queued rounds after the one in flight, also
        those dealt before the call (the last rounds of a fit all are)."""
        if self.stop_requested and not self._halted:
            self._halted = True
            self.checkpoints.cut(self._dealt.base + self.pool.halt())

    # -- the end -------------------------------------------------------------------------------
    def finish(self) -> tuple[ReplicaResult, list[dict[str, float]]]:
        """Collect every replica's ``Finished``: rank 0's result, and each worker's stats."""
        workers = self.plan.workers
        self._await_rounds()
        self.parent_cpu_s = time.process_time() - self._cpu_began
        for rank in range(workers):
            self.pool.send(rank, Finish())
        results: dict[int, ReplicaResult] = {}
        while len(results) < workers:
            finished = self._drain(block=True)
            if finished is not None:
                results[finished.rank] = finished.result
        return results[0], [results[r].stats for r in range(workers)]

    # -- checks and settings -------------------------------------------------------------------
    def _checked(self, batch: Any) -> Any:
        """The batch, once it is known to be an (inputs, targets) pair (a TypeError that says
        what a batch must be otherwise); a ``step_fn`` takes batches of any structure."""
        if self.plan.batches_are_pairs:
            split_batch(batch, training=True)
        return batch

    def _check_sharded(self, source: LoaderSpec, replies: Iterable[StepDone],
                       seen: set[str]) -> None:
        """Warn (once per fit) when two of an epoch's first batches are the same: every worker
        (or loader worker) reads the whole stream, so each batch is trained several times."""
        for reply in replies:
            if reply.digest is None:
                continue
            if reply.digest in seen and not self._warned_unsharded:
                self._warned_unsharded = True
                warn(
                    f"the workers read the same batches from your "
                    f"{type(source.dataset).__name__}: every worker iterates its own copy of an "
                    "IterableDataset, so unless it shards itself each batch is trained several "
                    "times. Shard it in __iter__: keep every info.world_size-th item from "
                    "info.rank on, with info = paraloom.replica_info(), and within a worker's "
                    "DataLoader every num_workers-th from torch.utils.data.get_worker_info().id")
            seen.add(reply.digest)

    def _stop_if_relaid(self, epoch: int) -> None:
        """Stop as ``epoch`` (after the first) starts when a listener froze or unfroze
        parameters, or changed the optimizer's param groups: the workers were built with the
        old ones."""
        if self.layout is None or self._model is None or self.stop_requested \
                or epoch == self.plan.start.epoch:
            return
        change = self.layout.changes(Layout.of(self._model, self.optimizer), self._model)
        if change is not None:
            self.relaid = (epoch, change)
            self.stop()

    def _send_settings(self) -> bool:
        """Send the user's optimizer settings to every replica, if they changed since sent;
        whether they had."""
        if self.optimizer is None:
            return False
        now = hyperparameters(self.optimizer)
        if not changed_settings(now, self.settings_sent):
            return False
        for rank in range(self.plan.workers):
            self.pool.send(rank, Hyperparameters(copy.deepcopy(now)))
        self.settings_sent = now
        return True

    def _warn_if_settings_changed(self) -> None:
        """Warn (once per fit) when a listener's ``on_iteration`` changed the optimizer's
        settings: the replicas take them only as the next epoch starts."""
        if self._warned_settings or self.optimizer is None or not self.listeners:
            return
        changed = changed_settings(hyperparameters(self.optimizer), self.settings_sent)
        if changed:
            self._warned_settings = True
            names = sorted({key for _, key in changed})
            warnings.warn(
                f"the optimizer's {names} changed during an epoch (a scheduler stepped in "
                f"on_iteration?); the replicas take settings changed in a listener as the "
                f"next epoch starts (on_epoch_start and on_epoch_end changes apply exactly). "
                f"For a per-step schedule pass ParallelWrapper(lr_scheduler=lambda opt: ...), "
                f"which every replica steps after every round", stacklevel=2)
