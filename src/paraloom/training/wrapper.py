"""ParallelWrapper: data-parallel training of one model over worker processes, with one fit()."""

from __future__ import annotations

import copy
import functools
import inspect
import itertools
import logging
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar, cast

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from paraloom.clipping import GradientClipping
from paraloom.data import (
    IndexedDataset,
    Prefetcher,
    as_data_source,
    cpu_copy,
    indexed_view,
    split_batch,
)
from paraloom.devices import DeviceSpec, training_devices
from paraloom.errors import NotPicklableError, WorkerError
from paraloom.forward import LossFn
from paraloom.listeners import TrainingListener, as_listener
from paraloom.precision import resolve_precision
from paraloom.sync.base import Synchronizer
from paraloom.sync.registry import build_synchronizer
from paraloom.training.loaders import LoaderSpec, epoch_batches, loader_spec
from paraloom.training.local_pool import LocalPool
from paraloom.training.messages import (
    Answer,
    Begin,
    CheckpointReply,
    Finish,
    Finished,
    Hyperparameters,
    IdleRound,
    IndexRound,
    LoaderEpoch,
    LoaderRound,
    ReplicaResult,
    ReplicaState,
    Round,
    RoundMessage,
    StepDone,
)
from paraloom.training.modes import TrainingMode
from paraloom.training.optim import OptimizerFactory, OptimizerSpec, load_state_copying
from paraloom.training.pool import Pool
from paraloom.training.process_pool import ProcessPool
from paraloom.training.recovery import RecoveringPool, Recovery
from paraloom.training.replica import SchedulerFactory, StepFn, require_loss
from paraloom.training.resume import CheckpointCollector, TrainingCheckpoint
from paraloom.training.runner import WorkerSpec, pickle_spec
from paraloom.training.tracker import RoundTracker
from paraloom.training.transport import shared_copy
from paraloom.training.versions import ReplicaMirror, changed_settings, hyperparameters

__all__ = ["ParallelWrapper"]

log = logging.getLogger("paraloom")


_Fit = TypeVar("_Fit", bound=Callable[..., Any])


def _one_fit_at_a_time(fit: _Fit) -> _Fit:
    """Refuse fit() while one is running (from a listener, or another thread)."""

    @functools.wraps(fit)
    def guarded(self: ParallelWrapper, *args: Any, **kwargs: Any) -> Any:
        if self._fit_thread is not None:
            raise RuntimeError("fit() was called while fit() is running (from a listener, or "
                               "another thread): a listener may call wrapper.stop() to end "
                               "training after the round in flight; call fit() again once the "
                               "running one has returned")
        self._fit_thread = threading.get_ident()
        try:
            return fit(self, *args, **kwargs)
        finally:
            self._fit_thread = None

    return cast(_Fit, guarded)


class ParallelWrapper:
    """Train ``model`` on ``workers`` replicas at once; ``fit()`` leaves the result in ``model``.

    ``devices`` (``"auto"``, ``"cpu"``, ``["cuda:0", "cuda:1"]``, a GPU count) places the
    replicas round robin; ``workers`` defaults to one per GPU (2 on the CPU). Workers are
    spawned processes, started on the first ``fit()`` and kept until ``close()``
    (or the end of a ``with`` block). Each round deals one batch to each worker; the
    ``training_mode`` decides how the replicas stay consistent.
    """

    def __init__(self, model: nn.Module, *, loss_fn: LossFn | None = None,
                 optimizer: torch.optim.Optimizer | OptimizerFactory,
                 workers: int | None = None, devices: DeviceSpec = "auto",
                 training_mode: str | TrainingMode | Synchronizer = TrainingMode.AVERAGING,
                 averaging_frequency: int = 1, average_updaters: bool = True,
                 prefetch_buffer: int = 16, report_score_after_averaging: bool = False,
                 step_fn: StepFn | None = None,
                 listeners: Iterable[TrainingListener | Callable[[int, int, float], object]] = (),
                 progress: bool = True, timeout: float = 300.0, precision: str = "32-true",
                 gradient_clip_val: float | None = None, gradient_clip_algorithm: str = "norm",
                 lr_scheduler: SchedulerFactory | None = None,
                 heartbeat_timeout: float | None = 2.0, step_timeout: float | None = None,
                 max_failures: int = 0, **sync_options: Any) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
        self.device_plan = training_devices(devices, workers)
        workers = self.device_plan.workers
        if prefetch_buffer < 0:
            raise ValueError(f"prefetch_buffer={prefetch_buffer}; expected >= 0")
        if timeout <= 0:
            raise ValueError(f"timeout={timeout}; expected seconds > 0")
        for name, value in (("heartbeat_timeout", heartbeat_timeout),
                            ("step_timeout", step_timeout)):
            if value is not None and not value > 0:
                raise ValueError(f"{name}={value!r}; expected seconds > 0, or None to turn "
                                 "this watch off")
        if not isinstance(max_failures, int) or max_failures < 0:
            raise ValueError(f"max_failures={max_failures!r}; expected an int >= 0 (0 raises "
                             "WorkerError at the first failure)")
        if max_failures and workers == 1:
            warnings.warn("max_failures= applies to worker processes; with workers=1 training "
                          "runs in this process and an error is raised as it happens",
                          stacklevel=2)
        self.model = model
        self.workers = workers
        self.prefetch_buffer = prefetch_buffer
        self.report_score_after_averaging = report_score_after_averaging
        self.progress = progress
        self.timeout = timeout
        self.heartbeat_timeout = heartbeat_timeout
        self.step_timeout = step_timeout
        self.max_failures = max_failures
        self.listeners: list[TrainingListener] = [as_listener(x) for x in listeners]
        _refuse_fit_arguments(sync_options)
        self.synchronizer = build_synchronizer(
            training_mode, averaging_frequency=averaging_frequency,
            average_updaters=average_updaters, **sync_options)
        self._user_optimizer = optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
        self.precision = resolve_precision(precision).name
        self.clipping = GradientClipping.of(gradient_clip_val, gradient_clip_algorithm)
        if lr_scheduler is not None and (isinstance(lr_scheduler, LRScheduler)
                                         or not callable(lr_scheduler)):
            raise TypeError(f"lr_scheduler={lr_scheduler!r}; expected a function that builds "
                            f"the scheduler on each replica's optimizer, e.g. lambda opt: "
                            f"OneCycleLR(opt, max_lr=0.1, total_steps=N) (a scheduler object "
                            f"steps your optimizer, which no replica trains with: step it in a "
                            f"listener's on_epoch_end instead)")
        self._spec = WorkerSpec(model=model, optimizer=OptimizerSpec.from_user(optimizer, model),
                                loss_fn=loss_fn, step_fn=step_fn, synchronizer=self.synchronizer,
                                precision=self.precision, clipping=self.clipping,
                                lr_scheduler=lr_scheduler)
        require_loss(loss_fn, step_fn)
        self._pool: Pool | None = None
        self._pool_layout = self._layout()
        """``_layout()`` when the pool started: a change restarts the workers."""
        self._iteration = 0
        self._stop_requested = False
        self._halted = False
        """Whether this fit's stop() was passed on to the workers (``_halt_if_stopped``)."""
        self._round_base = 0
        """The tracker's iteration when this fit's first round went out."""
        self._stats: dict[str, Any] = {}
        self._tracker: RoundTracker | None = None
        self._warned_unsharded = False
        self._mirror: ReplicaMirror | None = None
        """What the replicas hold after the last fit(): a warm fit() sends only changes."""
        self._sent = {"model_sent": True, "optimizer_state_sent": True}
        self._received: ReplicaResult | None = None
        """The last fit's result, held so that its shared memory (worker 0's outbox, which the
        next result reuses) stays mapped here: mapping 150 MB anew costs more than copying it."""
        self._checkpoints = CheckpointCollector(self.listeners, self.fingerprint, workers)
        self._settings_sent: list[dict[str, Any]] = []
        """The user's optimizer settings as the replicas last took them (``hyperparameters``)."""
        self._warned_settings = False
        self._fit_thread: int | None = None
        """The thread running fit(), while one does."""

    # -- lifecycle -----------------------------------------------------------------------------
    def __enter__(self) -> ParallelWrapper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the worker processes; the wrapper starts new ones if fit() is called again."""
        if self._fit_thread == threading.get_ident():
            raise RuntimeError("close() was called while fit() is running (from a listener?): "
                               "it would stop the workers under the running fit(). Call "
                               "wrapper.stop() to end training after the round in flight, and "
                               "close() once fit() has returned")
        self._close()

    def _close(self) -> None:
        self._mirror = None
        self._received = None  # its shared memory belonged to worker 0's outbox
        if self._pool is not None:
            pool, self._pool = self._pool, None
            pool.close()

    shutdown = close

    def __del__(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.kill()

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the running workers (empty before the first fit or with workers=1)."""
        return list(self._pool.pids) if self._pool is not None else []

    def stop(self) -> None:
        """Ask a running fit() to stop after the round in flight (e.g. from a listener); the
        rounds queued behind it are not trained."""
        self._stop_requested = True

    def _layout(self) -> tuple[tuple[bool, ...], tuple[tuple[int, ...], ...]]:
        """What the replicas are built with and a warm fit() cannot change in them: which
        parameters train (``requires_grad``), and the user's optimizer's param groups."""
        params = list(self.model.parameters())
        index = {id(p): i for i, p in enumerate(params)}
        groups = () if self._user_optimizer is None else tuple(
            tuple(index.get(id(p), -1) for p in g["params"])
            for g in self._user_optimizer.param_groups)
        return tuple(p.requires_grad for p in params), groups

    def _ensure_pool(self) -> Pool:
        layout = self._layout()
        if self._pool is not None and self._pool.alive and layout == self._pool_layout:
            return self._pool
        if self._pool is not None and self._pool.alive:
            log.info("the trainable parameters or the optimizer's param groups changed since "
                     "the workers started: restarting them")
        self._close()
        if self._user_optimizer is not None:  # its param groups as they are now
            self._spec = replace(self._spec, optimizer=OptimizerSpec.from_user(
                self._user_optimizer, self.model))
        self._pool_layout = layout
        if self.workers == 1:
            self._pool = LocalPool(self._spec, device=self.device_plan.devices[0])
        else:
            spec_bytes = pickle_spec(self._spec)
            queue_size = self._queue_depth()

            def start() -> ProcessPool:
                return ProcessPool(spec_bytes, self.workers, timeout_s=self.timeout,
                                   step_timeout_s=self.step_timeout,
                                   heartbeat_timeout_s=self.heartbeat_timeout,
                                   queue_size=queue_size, devices=self.device_plan)

            self._pool = RecoveringPool(start, self.max_failures, self._recovered) \
                if self.max_failures else start()
        return self._pool

    @property
    def recoveries(self) -> list[Recovery]:
        """The worker failures the last fit() survived (``max_failures=``), in order."""
        return list(self._tracker.recoveries) if self._tracker is not None else []

    def _recovered(self, recovery: Recovery) -> None:
        """A worker failed and the pool recovered: tell the listeners and the progress bar."""
        for listener in self.listeners:
            listener.on_worker_failure(recovery.rank, recovery.error, True)
        if self._tracker is not None:
            self._tracker.recovered(recovery)

    # -- training ------------------------------------------------------------------------------
    @_one_fit_at_a_time
    def fit(self, data: Any, epochs: int = 1, *, batch_size: int | None = None,
            shuffle: bool = False, resume_from: str | Path | None = None,
            initial_epoch: int = 0) -> dict[str, Any]:
        """Train for ``epochs`` passes over ``data``; the model then holds the trained weights.

        ``data`` yields ``(inputs, targets)`` batches (a DataLoader, a list, a re-iterable);
        a map-style Dataset is accepted with ``batch_size=``. ``resume_from`` (a checkpoint
        file or a CheckpointListener's directory) continues an interrupted run exactly: same
        total ``epochs``, same data. ``initial_epoch`` numbers the epochs from there (as in
        Keras: ``epochs`` is the index to stop before), for training driven epoch by epoch.
        Returns ``stats()``.
        """
        if not isinstance(epochs, int) or epochs < 1:
            raise ValueError(f"epochs={epochs!r}; expected an int >= 1")
        if not isinstance(initial_epoch, int) or not 0 <= initial_epoch < epochs:
            raise ValueError(f"initial_epoch={initial_epoch!r}; expected 0 <= initial_epoch < "
                             f"epochs={epochs}")
        data = as_data_source(data, batch_size, shuffle)
        start = self._start_position(resume_from, initial_epoch)
        pool = self._ensure_pool()
        self._stop_requested = self._halted = False
        tracker = RoundTracker(self.workers, self.listeners, iteration=self._iteration,
                               total_batches=_total(data, epochs - start.epoch),
                               progress=self.progress,
                               report_score=self.report_score_after_averaging)
        self._tracker = tracker
        self._checkpoints.reset()
        completed = False
        try:
            source = self._begin(pool, data, start)
            for listener in self.listeners:
                listener.on_fit_start(self)
            self._deal(pool, tracker, data, source, epochs, start)
            result = self._finish(pool, tracker)
            completed = True
        except BaseException as e:
            self._mirror = None
            if self._pool is not None:
                self._pool.kill()
                self._pool = None
            if isinstance(e, WorkerError):
                if where := tracker.batch_of(e.batch, e.worker):
                    e.args = (f"{e.args[0]}\n(at {where})",)
                for listener in self.listeners:
                    listener.on_worker_failure(e.worker, e, False)
            raise
        finally:
            self._iteration = tracker.iteration
            tracker.close(completed)
        self._adopt(result)
        self._received = result
        self._mirror = ReplicaMirror(self.model, self._user_optimizer, pool)
        for listener in self.listeners:
            listener.on_fit_end(self)
        return self.stats()

    def _start_position(self, resume_from: str | Path | None, initial_epoch: int) -> _Position:
        if resume_from is None:
            return _Position(epoch=initial_epoch)
        ckpt = TrainingCheckpoint.load(resume_from)
        ckpt.check(self.fingerprint(), resume_from)
        self._iteration = ckpt.iteration
        return _Position(ckpt.epoch, ckpt.batch, ckpt.data_rng, ckpt.replicas)

    def fingerprint(self) -> dict[str, Any]:
        """What a checkpoint must match to be resumed by this wrapper."""
        fingerprint = {
            "model": type(self.model).__qualname__,
            "parameters": [[k, list(v.shape)] for k, v in self.model.state_dict().items()],
            "workers": self.workers, "training_mode": self.synchronizer.name,
            "synchronizer": self.synchronizer.config(), "precision": self.precision}
        spec = self._spec.optimizer
        if spec.cls is not None:  # a factory's optimizer is known only once it is built
            fingerprint["optimizer"] = spec.cls.__qualname__
            fingerprint["optimizer_param_groups"] = [len(g["params"]) for g in spec.groups]
        return fingerprint

    def live_stats(self) -> dict[str, Any]:
        """Live counters of the running fit(): batches, samples, seconds, total batches."""
        t = self._tracker
        if t is None:
            return {"batches": 0, "samples": 0, "seconds": 0.0, "total_batches": None}
        return {"batches": t.batches, "samples": t.rows, "seconds": t.seconds,
                "total_batches": t.bar.total}

    def _begin(self, pool: Pool, data: Any, start: _Position) -> _Source:
        """Start the fit on every worker; returns what the workers load themselves: the loader
        each runs, or the dataset dealt by index (None: batches go through this process).

        The user's model and optimizer are the master copies: their current state goes out
        (a learning rate changed between fits applies), and the workers' RNGs are seeded from
        the caller's, so ``torch.manual_seed`` makes dropout reproducible too. On a warm pool
        the model and the optimizer state go out only if they changed since the last fit()
        (``versions.ReplicaMirror``); the optimizer's hyperparameters always do.
        """
        loader = loader_spec(data)
        indexed = indexed_view(data) if loader is None else None
        user_opt = self._user_optimizer
        mirror = self._mirror if self._mirror is not None and self._mirror.pool is pool \
            and pool.warm and start.replicas is None else None
        send_model = mirror is None or not mirror.model_unchanged(self.model)
        send_opt = user_opt is not None and (
            mirror is None or not mirror.optimizer_unchanged(user_opt))
        self._sent = {"model_sent": send_model, "optimizer_state_sent": send_opt}
        # Copies: never share the user's tensors with the workers.
        opt = copy.deepcopy(user_opt.state_dict()) if user_opt is not None and send_opt \
            else None
        settings = hyperparameters(user_opt) if user_opt is not None and not send_opt \
            else None
        self._settings_sent = hyperparameters(user_opt) if user_opt is not None else []
        self._warned_settings = False
        if user_opt is not None:
            # The replicas step copies of it: torch's schedulers check this flag to warn of a
            # scheduler.step() before any optimizer.step(), which a listener's step is not.
            setattr(user_opt, "_opt_called", True)  # noqa: B010
        seed = int(torch.randint(0, 2**62, ()).item())
        state = cpu_copy(self.model.state_dict()) if send_model else None

        def messages(dataset: IndexedDataset | None) -> list[Begin]:
            return [Begin(state, dataset, start.replicas[rank] if start.replicas else None,
                          opt, seed, loader, settings) for rank in range(self.workers)]

        try:
            pool.begin(messages(indexed))
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
            pool.begin(messages(None))
        return loader or indexed

    def _deal(self, pool: Pool, tracker: RoundTracker, data: Any, source: _Source,
              epochs: int, start: _Position) -> None:
        dealing = _Dealing(base=tracker.iteration)
        self._round_base = dealing.base
        self._warned_unsharded = False
        for epoch in range(start.epoch, epochs):
            if epoch > start.epoch:
                self._await_rounds(pool, tracker)
                tracker.end_epoch()
            if not self._stop_requested:
                tracker.start_epoch(epoch)
            if self._stop_requested:
                self._halt_if_stopped(pool)
                return
            # What the epoch's listeners changed (a scheduler's step) applies from its first
            # round on: every earlier round is done, none of this epoch's is dealt.
            self._send_settings(pool)
            generators = _data_generators(data)
            if epoch == start.epoch and start.data_rng is not None:
                _set_data_rng(start.data_rng, generators)  # the interrupted epoch's order
            epoch_rng = [torch.get_rng_state(), *(g.get_state() for g in generators)]
            skip = start.batch if epoch == start.epoch else 0
            if isinstance(source, LoaderSpec) and source.stream:
                dealt = self._deal_stream(pool, tracker, source, epoch, skip, epoch_rng,
                                          dealing)
            else:
                dealt = self._deal_epoch(pool, tracker, data, source, epoch, skip, epoch_rng,
                                         dealing)
            if self._stop_requested:
                self._halt_if_stopped(pool)
                return
            if dealt == 0 and epoch == start.epoch:
                raise ValueError("data yielded no batches at all (an empty generator or "
                                 "IterableDataset?); expected at least one (inputs, targets) "
                                 "batch")
            if dealt == 0:
                raise ValueError(f"data yielded no batches in epoch {epoch}: pass a re-iterable "
                                 "source (a DataLoader or a list), not a one-shot generator")
            if dealing.round_id:
                stream = isinstance(source, LoaderSpec) and source.stream
                # Nothing has drawn from the data RNG since the epoch ended: its state now is
                # where the next epoch starts.
                following = [torch.get_rng_state(), *(g.get_state() for g in generators)] \
                    if stream else None
                self._checkpoints.request(pool, dealing.base + dealing.round_id - 1, epoch,
                                          dealt, epoch_rng, True, following)

    def _deal_epoch(self, pool: Pool, tracker: RoundTracker, data: Any, source: _Source,
                    epoch: int, skip: int, epoch_rng: list[torch.Tensor],
                    dealing: _Dealing) -> int:
        """Deal one epoch whose batches are known up front, a round at a time without waiting
        for replies (bounded by the workers' queues); returns the batches dealt."""
        dealt = skip
        for payloads in self._rounds(pool, data, source, epoch, skip):
            # Wait for replies rather than for room in a full queue: listeners (and the
            # progress bar) then run as each round finishes, not a round late.
            while tracker.in_flight >= self._queue_depth():
                self._handle(pool, pool.recv(timeout_s=None), tracker)
            round_id = dealing.round_id
            tracker.add(round_id, epoch, dealt, len(payloads))
            for rank in range(self.workers):
                pool.send(rank, _round(source, round_id, epoch, payloads[rank])
                          if rank < len(payloads) else IdleRound(round_id))
            dealt += len(payloads)
            self._checkpoints.request(pool, dealing.base + round_id, epoch, dealt, epoch_rng,
                                      False)
            dealing.round_id += 1
            self._drain(pool, tracker, block=False)
            if self._stop_requested:
                break
        return dealt

    def _queue_depth(self) -> int:
        """Rounds a worker's queue holds: how far the parent deals ahead of the replies."""
        return max(2, -(-self.prefetch_buffer // self.workers))

    def _deal_stream(self, pool: Pool, tracker: RoundTracker, source: LoaderSpec, epoch: int,
                     skip: int, epoch_rng: list[torch.Tensor], dealing: _Dealing) -> int:
        """Deal one epoch of an IterableDataset that every worker iterates itself: a round
        goes out once the last is answered, to the workers whose stream goes on (the others
        take part idly) until every stream has ended. A checkpoint's ``batch`` counts
        ``workers`` per round, so a resumed worker skips ``batch // workers`` of its batches."""
        seed = int(torch.randint(0, 2**62, ()).item())
        for rank in range(self.workers):
            pool.send(rank, LoaderEpoch(epoch, seed))
        active, position, dealt, trained = list(range(self.workers)), skip // self.workers, \
            skip, False
        seen: set[str] = set()
        while active:
            round_id = dealing.round_id
            tracker.add(round_id, epoch, dealt, len(active))
            for rank in range(self.workers):
                pool.send(rank, LoaderRound(round_id, epoch, position) if rank in active
                          else IdleRound(round_id))
            replies = self._await_round(pool, tracker, round_id)
            active = [rank for rank in active if replies[rank].more]
            trained = trained or any(r.loss is not None for r in replies.values())
            self._check_sharded(source, replies.values(), seen)
            position, dealt = position + 1, dealt + self.workers
            self._checkpoints.request(pool, dealing.base + round_id, epoch, dealt, epoch_rng,
                                      False)
            dealing.round_id += 1
            if self._stop_requested:
                break
        return dealt if trained else skip

    def _await_rounds(self, pool: Pool, tracker: RoundTracker) -> None:
        """Handle replies until every round dealt is done (its listeners called)."""
        while tracker.in_flight:
            self._handle(pool, pool.recv(timeout_s=None), tracker)

    def _send_settings(self, pool: Pool) -> None:
        """Send the user's optimizer settings to every replica, if they changed since sent."""
        user_opt = self._user_optimizer
        if user_opt is None:
            return
        now = hyperparameters(user_opt)
        if changed_settings(now, self._settings_sent):
            for rank in range(self.workers):
                pool.send(rank, Hyperparameters(copy.deepcopy(now)))
            self._settings_sent = now

    def _await_round(self, pool: Pool, tracker: RoundTracker,
                     round_id: int) -> dict[int, StepDone]:
        """Handle replies until every worker has answered round ``round_id``."""
        got: dict[int, StepDone] = {}
        while len(got) < self.workers:
            reply = pool.recv(timeout_s=None)
            self._handle(pool, reply, tracker)
            if isinstance(reply, StepDone) and reply.round_id == round_id:
                got[reply.rank] = reply
        return got

    def _check_sharded(self, source: LoaderSpec, replies: Iterable[StepDone],
                       seen: set[str]) -> None:
        """Warn (once per fit) when two of an epoch's first batches are the same: every worker
        (or loader worker) reads the whole stream, so each batch is trained several times."""
        for reply in replies:
            if reply.digest is None:
                continue
            if reply.digest in seen and not self._warned_unsharded:
                self._warned_unsharded = True
                warnings.warn(
                    f"the workers read the same batches from your "
                    f"{type(source.dataset).__name__}: every worker iterates its own copy of an "
                    "IterableDataset, so unless it shards itself each batch is trained several "
                    "times. Shard it in __iter__: keep every info.world_size-th item from "
                    "info.rank on, with info = paraloom.replica_info(), and within a worker's "
                    "DataLoader every num_workers-th from torch.utils.data.get_worker_info().id",
                    stacklevel=4)
            seen.add(reply.digest)

    def _rounds(self, pool: Pool, data: Any, source: _Source, epoch: int,
                skip: int = 0) -> Iterator[list[Any]]:
        """Group the epoch's batches (index lists for an indexed dataset, positions in each
        worker's share for a loader) into rounds of ``workers`` (the last may be short)."""
        if isinstance(source, LoaderSpec):
            yield from self._loader_rounds(pool, data, epoch, skip)
            return
        if source is not None:
            batches = itertools.islice(data.batch_sampler, skip, None)
            payloads: Iterable[Any] = (list(b) for b in batches)
            prefetcher = None
        else:
            # Copy each batch as it is read: a source may refill one buffer for every batch.
            copied = (shared_copy(self._checked(b)) for b in itertools.islice(data, skip, None))
            # prefetch_buffer counts batches per worker, as DL4J's prefetchBuffer does.
            prefetcher = Prefetcher(copied, self.prefetch_buffer * self.workers) \
                if self.prefetch_buffer else None
            payloads = prefetcher or copied
        try:
            chunk: list[Any] = []
            for payload in payloads:
                chunk.append(payload)
                if len(chunk) == self.workers:
                    yield chunk
                    chunk = []
            if chunk:
                yield chunk
        finally:
            if prefetcher is not None:
                prefetcher.close()

    def _checked(self, batch: Any) -> Any:
        """The batch, once it is known to be an (inputs, targets) pair (a TypeError that says
        what a batch must be otherwise); a ``step_fn`` takes batches of any structure."""
        if self._spec.step_fn is None:
            split_batch(batch)
        return batch

    def _loader_rounds(self, pool: Pool, data: Any, epoch: int,
                       skip: int) -> Iterator[list[int]]:
        """Send each worker its share of the epoch's batches (``LoaderEpoch``: batch ``skip +
        rank``, then every ``workers``-th); a round is the next position in every share."""
        batches = epoch_batches(data)[skip:]
        seed = int(torch.randint(0, 2**62, ()).item())
        for rank in range(self.workers):
            pool.send(rank, LoaderEpoch(epoch, seed, batches[rank::self.workers], skip + rank,
                                        self.workers))
        for position in range(-(-len(batches) // self.workers)):
            yield [position] * min(self.workers, len(batches) - position * self.workers)

    def _drain(self, pool: Pool, tracker: RoundTracker, block: bool) -> Finished | None:
        """Handle worker replies until none is waiting, or (``block``) until one finishes."""
        while True:
            reply = pool.recv(timeout_s=None if block else 0)
            if reply is None:
                return None
            if isinstance(reply, Finished):
                return reply
            self._handle(pool, reply, tracker)

    def _halt_if_stopped(self, pool: Pool) -> None:
        """After ``stop()``: every worker skips the queued rounds after the one in flight, also
        those dealt before the call (the last rounds of a fit all are)."""
        if self._stop_requested and not self._halted:
            self._halted = True
            self._checkpoints.cut(self._round_base + pool.halt())

    def _handle(self, pool: Pool, reply: Answer | None, tracker: RoundTracker) -> None:
        """Account for a worker's reply to a round or a checkpoint request; then pass on a
        ``stop()`` that a listener it ran may have called."""
        match reply:
            case StepDone():
                tracker.reply(reply.round_id, reply.loss, reply.rows, reply.synced,
                              reply.skipped)
                self._warn_if_settings_changed()
            case CheckpointReply():
                self._checkpoints.receive(reply)
        self._halt_if_stopped(pool)

    def _warn_if_settings_changed(self) -> None:
        """Warn (once per fit) when a listener's ``on_iteration`` changed the optimizer's
        settings: the replicas take them only as the next epoch starts."""
        user_opt = self._user_optimizer
        if self._warned_settings or user_opt is None or not self.listeners:
            return
        changed = changed_settings(hyperparameters(user_opt), self._settings_sent)
        if changed:
            self._warned_settings = True
            names = sorted({key for _, key in changed})
            warnings.warn(
                f"the optimizer's {names} changed during an epoch (a scheduler stepped in "
                f"on_iteration?); the replicas take settings changed in a listener as the "
                f"next epoch starts (on_epoch_start and on_epoch_end changes apply exactly). "
                f"For a per-step schedule pass ParallelWrapper(lr_scheduler=lambda opt: ...), "
                f"which every replica steps after every round", stacklevel=2)

    def _finish(self, pool: Pool, tracker: RoundTracker) -> ReplicaResult:
        for rank in range(self.workers):
            pool.send(rank, Finish())
        results: dict[int, ReplicaResult] = {}
        while len(results) < self.workers:
            finished = self._drain(pool, tracker, block=True)
            if finished is not None:
                results[finished.rank] = finished.result
        per_worker = [results[r].stats for r in range(self.workers)]
        self._stats = {**tracker.summary(), **self._sent, "workers": self.workers,
                       "failures": len(tracker.recoveries),
                       "seconds_lost": tracker.seconds_lost(),
                       "mode": self.synchronizer.name, "per_worker": per_worker,
                       "bytes_sent_per_step": [w.get("bytes_sent_per_step", 0.0)
                                               for w in per_worker]}
        return results[0]

    def _adopt(self, result: ReplicaResult) -> None:
        """Load rank 0's final parameters (and optimizer state) into the user's objects."""
        if result.state is None:
            raise WorkerError("worker 0 finished without sending the trained parameters",
                              worker=0)
        with torch.no_grad():
            self.model.load_state_dict(result.state)
        user_opt = self._user_optimizer
        if user_opt is not None and result.optimizer_state is not None:
            # Settings a listener changed after the replicas last took them (a scheduler
            # stepped in the last on_epoch_end) stay the user's: they apply from the next fit.
            mine = hyperparameters(user_opt)
            kept = changed_settings(mine, self._settings_sent)
            try:
                load_state_copying(user_opt, result.optimizer_state)
            except (ValueError, KeyError) as e:  # a factory-built optimizer may differ in shape
                log.debug("optimizer state not copied back: %s", e)
            for group, key in kept:
                if group < len(user_opt.param_groups) and key in mine[group]:
                    user_opt.param_groups[group][key] = mine[group][key]

    def stats(self) -> dict[str, Any]:
        """Counters of the last fit(): rounds, samples, samples/s, bytes sent per step."""
        return dict(self._stats)


_Source = LoaderSpec | IndexedDataset | None
"""What the workers load themselves: their own DataLoader, a dataset to gather rows of by index,
or nothing (batches go through the parent)."""


@dataclass
class _Dealing:
    """Rounds dealt in this fit() so far, and the iteration the fit began at."""

    base: int
    round_id: int = 0


def _round(source: _Source, round_id: int, epoch: int, payload: Any) -> RoundMessage:
    """The message that deals ``payload`` (a batch, an index list, a position) in a round."""
    if isinstance(source, LoaderSpec):
        return LoaderRound(round_id, epoch, payload)
    if source is not None:
        return IndexRound(round_id, payload)
    return Round(round_id, payload)


@dataclass
class _Position:
    """Where a fit() starts: an epoch, batches of it already trained, and the data RNG."""

    epoch: int = 0
    batch: int = 0
    data_rng: list[torch.Tensor] | None = None
    replicas: list[ReplicaState | None] | None = None


def _data_generators(data: Any) -> list[torch.Generator]:
    """The data source's own generators (a DataLoader's, its sampler's), each once."""
    found: list[torch.Generator] = []
    sampler = getattr(data, "sampler", None)
    batch_sampler = getattr(data, "batch_sampler", None)
    for g in (getattr(data, "generator", None), getattr(sampler, "generator", None),
              getattr(getattr(batch_sampler, "sampler", None), "generator", None)):
        if isinstance(g, torch.Generator) and all(g is not x for x in found):
            found.append(g)
    return found


def _set_data_rng(states: list[torch.Tensor], generators: list[torch.Generator]) -> None:
    if len(states) != len(generators) + 1:
        raise ValueError(f"the checkpoint holds {len(states) - 1} data generator state(s) but "
                         f"this data source has {len(generators)}: resume with the same kind of "
                         "DataLoader (with or without generator=) as the interrupted run")
    torch.set_rng_state(states[0])
    for g, state in zip(generators, states[1:], strict=True):
        g.set_state(state)


def _refuse_fit_arguments(options: dict[str, Any]) -> None:
    """Refuse fit()'s arguments (epochs=, batch_size=, ...) given to the constructor."""
    fit_arguments = set(inspect.signature(ParallelWrapper.fit).parameters) - {"self", "data"}
    misplaced = sorted(fit_arguments & set(options))
    if misplaced:
        names = ", ".join(f"{k}=" for k in misplaced)
        verbs = ("is not a ParallelWrapper option; it goes", "are not ParallelWrapper options; "
                 "they go")[len(misplaced) > 1]
        example = ", ".join(f"{k}={options[k]!r}" for k in misplaced)
        raise TypeError(f"{names} {verbs} to fit(): wrapper.fit(data, {example})")


def _total(data: Any, epochs: int) -> int | None:
    try:
        return len(data) * epochs
    except TypeError:
        return None
