"""ParallelWrapper: data-parallel training of one model over worker processes, with one fit()."""

from __future__ import annotations

import contextlib
import copy
import logging
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from paraloom._warnings import warn
from paraloom.data import as_data_source
from paraloom.devices import DeviceSpec, training_devices
from paraloom.errors import FitInterrupted, WorkerError
from paraloom.extra_state import tensors_of
from paraloom.forward import LossFn
from paraloom.listeners import TrainingListener, as_listener
from paraloom.precision import resolve_precision
from paraloom.sync.base import Synchronizer
from paraloom.sync.registry import build_synchronizer, warn_without_idle_step
from paraloom.training.buffers import load_model_state
from paraloom.training.dealing import total_batches
from paraloom.training.exit_close import close_at_exit
from paraloom.training.fit_guard import FitGuard, one_fit_at_a_time
from paraloom.training.fit_run import FitPlan, FitRun, Start
from paraloom.training.interrupts import deferred_interrupt, graceful_interrupt
from paraloom.training.layout import Layout, relaid_error
from paraloom.training.local_pool import LocalPool
from paraloom.training.messages import ReplicaResult
from paraloom.training.mirror import ReplicaMirror, changed_settings, hyperparameters
from paraloom.training.model_checks import check_user_model
from paraloom.training.modes import TrainingMode
from paraloom.training.optim import (
    OptimizerFactory,
    OptimizerSpec,
    load_state_copying,
    trained_state,
)
from paraloom.training.options import (
    FaultTolerance,
    LoopOptions,
    StepOptions,
    WrapperKeywords,
    refuse_misplaced,
    split_keywords,
)
from paraloom.training.pool import Pool
from paraloom.training.process_pool import ProcessPool
from paraloom.training.recovery import RecoveringPool, Recovery, warn_lost_between_fits
from paraloom.training.replica import StepFn, require_loss
from paraloom.training.resume import CheckpointCollector, TrainingCheckpoint
from paraloom.training.runner import WorkerSpec, pickle_spec
from paraloom.training.schedules import check_scheduler_factory
from paraloom.training.step_checks import check_fit, refuse_one_shot, warn_if_trained
from paraloom.training.tracker import FitStats, RoundTracker

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from paraloom.sync.sharing import SharingRecipe

__all__ = ["FitStats", "ParallelWrapper"]

log = logging.getLogger("paraloom")
_WELL_CLOSE_S = 5.0
"""How long workers that are well get to stop after a fit failed in this process."""


def _listeners(given: object) -> list[TrainingListener]:
    """``listeners=``: an iterable of listeners (or callables), or one given alone."""
    if isinstance(given, TrainingListener) or callable(given):
        return [as_listener(given)]
    if not isinstance(given, Iterable) or isinstance(given, str | bytes):
        raise TypeError(f"listeners={given!r}; expected a list of TrainingListener objects or "
                        "callables (iteration, epoch, loss)")
    return [as_listener(x) for x in given]


class ParallelWrapper:
    """Train ``model`` on ``workers`` replicas at once; ``fit()`` leaves the result in ``model``.

    ``devices`` (``"auto"``, ``"cpu"``, ``["cuda:0", "cuda:1"]``, a GPU count) places the
    replicas round robin; ``workers`` defaults to one per GPU (2 on the CPU). Workers are
    processes, started on the first ``fit()`` and kept until ``close()`` (or the end of a
    ``with`` block). Each round deals one batch to each worker; ``training_mode`` decides how
    the replicas stay consistent: ``"averaging"`` (the default), ``"shared_gradients"``,
    ``"allreduce"``, ``"diloco"``, a ``TrainingMode``, or a ``Synchronizer`` instance.
    ``sharing`` (a ``SharingRecipe``) configures ``"shared_gradients"``, which it implies.

    The options come in groups: ``steps`` (``StepOptions``: ``lr_scheduler``, gradient
    clipping, ``accumulate``, ``compile``), ``faults`` (``FaultTolerance``: ``max_failures``,
    ``timeout``, ``heartbeat_timeout``, ``step_timeout``, ``spares``) and ``loop`` (``LoopOptions``:
    ``prefetch_buffer``, ``progress``, ``report_score_after_averaging``). Each of their
    options is also a keyword of its own, and so is every option of the training mode
    (``averaging_frequency=3``, ``threshold_algorithm=...``, ``bucket_cap_mb=...``): see
    ``WrapperKeywords``. A keyword wins over its group object.

    Raises ``TypeError`` for a model that is not an ``nn.Module``, a keyword no group or
    mode takes, ``fit()``'s arguments given here, or ``sharing`` with another mode;
    ``ValueError`` for a bad option value (the message names it and the fix).
    """

    def __init__(self, model: nn.Module, *, loss_fn: LossFn | None = None,
                 optimizer: torch.optim.Optimizer | OptimizerFactory,
                 step_fn: StepFn | None = None, workers: int | None = None,
                 devices: DeviceSpec = "auto",
                 training_mode: str | TrainingMode | Synchronizer | None = None,
                 sharing: SharingRecipe | None = None, precision: str = "32-true",
                 listeners: Iterable[TrainingListener | Callable[[int, int, float], object]] = (),
                 steps: StepOptions | None = None, faults: FaultTolerance | None = None,
                 loop: LoopOptions | None = None,
                 **options: Unpack[WrapperKeywords]) -> None:
        check_user_model(model)
        refuse_misplaced(dict(options), ParallelWrapper.fit)
        self.steps, self.faults, self.loop, sync_options = split_keywords(
            dict(options), steps=steps, faults=faults, loop=loop)
        self.device_plan = training_devices(devices, workers)
        self.workers = self.device_plan.workers
        if self.faults.max_failures and self.workers == 1:
            warnings.warn("max_failures= applies to worker processes; with workers=1 training "
                          "runs in this process and an error is raised as it happens",
                          stacklevel=2)
        self.model = model
        self.listeners: list[TrainingListener] = _listeners(listeners)
        self.synchronizer = _synchronizer(training_mode, sharing, sync_options)
        if self.workers > 1:
            warn_without_idle_step(self.synchronizer)
        self.synchronizer.check_model(model)
        self._user_optimizer = optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
        self.precision = resolve_precision(precision).name
        self.clipping = self.steps.clipping
        self._spec = WorkerSpec(model=model, optimizer=OptimizerSpec.from_user(optimizer, model),
                                loss_fn=loss_fn, step_fn=step_fn, synchronizer=self.synchronizer,
                                precision=self.precision, clipping=self.clipping,
                                lr_scheduler=self.steps.lr_scheduler,
                                accumulate=self.steps.accumulate,
                                compile_options=self.steps.compile_options)
        require_loss(loss_fn, step_fn)
        check_scheduler_factory(self.steps.lr_scheduler, self._spec.optimizer, model,
                                self._user_optimizer)
        self._pool: Pool | None = None
        self._pool_layout = Layout.of(model, self._user_optimizer)
        """The layout when the pool started: a change restarts the workers."""
        self._iteration = 0
        self._epoch_batches: int | None = None  # the current fit's data, when it has a length
        self._run: FitRun | None = None
        """The running fit(), or the last one until close() (it holds the pool)."""
        self._tracker: RoundTracker | None = None  # the last fit's: recoveries, live_stats
        self._stats: FitStats | None = None
        self._mirror: ReplicaMirror | None = None
        """What the replicas hold after the last fit(): a warm fit() sends only changes."""
        self._received: ReplicaResult | None = None
        """The last fit's result, held so that its shared memory (worker 0's outbox, which the
        next result reuses) stays mapped here: mapping 150 MB anew costs more than copying it."""
        self._checkpoints = CheckpointCollector(self.listeners, self.fingerprint, self.workers)
        self._fit_guard = FitGuard()
        """The thread running fit(), while one does."""

    # -- lifecycle -----------------------------------------------------------------------------
    def __enter__(self) -> ParallelWrapper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the worker processes; the wrapper starts new ones if fit() is called again.

        From another thread while fit() runs, it first stops that fit as ``stop()`` does and
        waits for it to return (the model gets what was trained). Raises ``RuntimeError`` from
        the running fit's own thread (a listener), ``TimeoutError`` when the running fit has
        not returned within ``step_timeout`` (or ``timeout``) and 5 s."""
        guard = self._fit_guard
        if guard.in_fit():
            raise RuntimeError("close() was called while fit() is running (from a listener?): "
                               "it would stop the workers under the running fit(). Call "
                               "wrapper.stop() to end training after the round in flight, and "
                               "close() once fit() has returned")
        if guard.running:
            guard.closing = True
            self.stop()
            wait_s = (self.faults.step_timeout or self.faults.timeout) + _WELL_CLOSE_S
            if not guard.wait_idle(wait_s):
                raise TimeoutError(f"close(): the fit() running in another thread did not "
                                   f"stop within {wait_s:g} s; call close() again once it "
                                   "has returned")
        self._close()

    def _close(self) -> None:
        self._run = None  # it holds the pool: a closed wrapper kept its pipes and store port
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
        """Ask a running fit() to stop after the round the workers are training now (e.g. from
        a listener); the rounds queued behind it are not trained. Listeners hear of rounds a
        message late (several rounds to a message), so from ``on_iteration`` the stop comes a
        few rounds past the one heard of, how many depending on timing; from
        ``on_epoch_end`` it is exact. Between fits it does nothing."""
        if self._run is not None and self._fit_guard.running:
            self._run.stop()

    def _ensure_pool(self) -> Pool:
        layout = Layout.of(self.model, self._user_optimizer)
        if self._pool is not None and self._pool.alive and layout == self._pool_layout:
            return self._pool
        if self._pool is not None and self._pool.alive:
            log.info("the trainable parameters or the optimizer's param groups changed since "
                     "the workers started: restarting them")
        elif self._pool is not None and layout == self._pool_layout:
            if isinstance(self._pool, RecoveringPool) and self._pool.revive():
                return self._pool  # lost between fits: new workers, from where the last ended
            warn_lost_between_fits()
        self._close()
        if self._user_optimizer is not None:  # its param groups as they are now
            self._spec = replace(self._spec, optimizer=OptimizerSpec.from_user(
                self._user_optimizer, self.model))
        self._pool_layout = layout
        if self.workers == 1:
            self._pool = LocalPool(self._spec, device=self.device_plan.devices[0])
            return self._pool
        spec_bytes, faults = pickle_spec(self._spec), self.faults
        queue_size = self.loop.queue_depth(self.workers)

        def start() -> ProcessPool:
            return ProcessPool(spec_bytes, self.workers, timeout_s=faults.timeout,
                               step_timeout_s=faults.step_timeout,
                               heartbeat_timeout_s=faults.heartbeat_timeout,
                               queue_size=queue_size, devices=self.device_plan,
                               survive=faults.max_failures > 0, spares=faults.spares)

        self._pool = close_at_exit(RecoveringPool(
            start, faults.max_failures, self._recovered, spares=faults.spares,
            spare_wait_s=faults.timeout) if faults.max_failures else start())
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
    @one_fit_at_a_time
    def fit(self, data: Any, epochs: int = 1, *, batch_size: int | None = None,
            shuffle: bool = False, resume_from: str | Path | None = None,
            initial_epoch: int = 0) -> FitStats:
        """Train for ``epochs`` passes over ``data``; the model then holds the trained weights.

        ``data`` yields ``(inputs, targets)`` batches (a DataLoader, a list, a re-iterable);
        a map-style Dataset is accepted with ``batch_size=``. ``resume_from`` (a checkpoint
        file or a CheckpointListener's directory) continues an interrupted run exactly: same
        total ``epochs``, same data. ``initial_epoch`` numbers the epochs from there (as in
        Keras: ``epochs`` is the index to stop before), for training driven epoch by epoch.
        Returns ``stats()``. Ctrl-C stops the fit after the round in flight, keeps what was
        trained in the model, then raises ``FitInterrupted`` (a ``KeyboardInterrupt``); a
        second Ctrl-C aborts at once, leaving the model as it was before the fit (one that comes
        while the trained weights are copied into the model waits for the copy: the model is
        never left half updated).

        Raises ``WorkerError`` when a replica fails (its exception's class in ``remote_type``,
        e.g. ``"NonFiniteLossError"``, its traceback in ``remote_traceback``; or a worker died
        or hung, past ``max_failures``), at ``workers=1`` too; the model keeps the weights it
        had before the fit. ``ValueError`` or ``TypeError`` for arguments or data it cannot
        train on, and for a ``resume_from`` checkpoint of another run (naming the difference);
        ``FileNotFoundError`` for a missing ``resume_from``; ``RuntimeError`` for a ``fit()``
        called while one runs; ``FitInterrupted`` as above. ``ValueError`` too when a listener
        froze or unfroze parameters or changed the optimizer's param groups during the fit:
        the fit stops as the next epoch begins, the epochs before it trained into the model,
        and the message names the ``fit(..., initial_epoch=)`` that goes on.
        """
        data, start = self._checked(data, epochs, batch_size, shuffle, resume_from,
                                    initial_epoch)
        with graceful_interrupt(lambda: None) as interrupted_early:  # the workers' start
            pool = self._ensure_pool()
        run = self._run = self._new_run(data, epochs, start, pool)
        if self._fit_guard.closing or interrupted_early():  # close() from another thread, or
            run.stop()  # Ctrl-C while the workers started: the fit stops before it trains
        tracker = self._tracker = run.tracker
        completed = False
        try:
            with graceful_interrupt(run.stop) as interrupted:
                source = run.begin(self.model, self._mirror)
                for listener in self.listeners:
                    listener.on_fit_start(self)
                run.deal(source)
                result = self._finish(run)
            completed = True
        except BaseException as e:
            if isinstance(e, WorkerError):
                run.salvage()
            self._failed(e, tracker)
            raise
        finally:
            self._iteration = tracker.iteration
            tracker.close(completed)
        self._take(result, run, pool)
        for listener in self.listeners:
            listener.on_fit_end(self)
        if interrupted() or interrupted_early():
            raise FitInterrupted(tracker.iteration)
        if run.relaid is not None:
            raise relaid_error(*run.relaid, epochs)
        return self.stats()

    def _checked(self, data: Any, epochs: int, batch_size: int | None, shuffle: bool,
                 resume_from: str | Path | None, initial_epoch: int
                 ) -> tuple[Iterable[Any], Start]:
        """``fit``'s arguments checked: the data source, and where the fit starts."""
        check_fit(self.model, epochs, initial_epoch, resume_from)
        one_shot = isinstance(data, Iterator)  # iter(data) is data: one pass, then empty
        kind = type(data).__name__
        source = as_data_source(data, batch_size, shuffle)
        self._epoch_batches = total_batches(source, 1)
        start = self._start_position(resume_from, initial_epoch)
        warn_if_trained(start.epoch + start.epoch_done(self._epoch_batches), epochs)
        if one_shot:
            refuse_one_shot(kind, epochs - start.epoch)
        return source, start

    def _take(self, result: ReplicaResult, run: FitRun, pool: Pool) -> None:
        """The trained state into the user's model: all of it, or none (a Ctrl-C meanwhile
        waits for the copy, then raises)."""
        with deferred_interrupt():
            self._adopt(result, run.settings_sent)
            self._received = result
            self._mirror = ReplicaMirror(self.model, self._user_optimizer, pool)

    def _new_run(self, data: Iterable[Any], epochs: int, start: Start, pool: Pool) -> FitRun:
        """This fit's run: its round tracker (the progress bar, the listeners' calls) and its
        plan of rounds from ``start``."""
        tracker = RoundTracker(self.workers, self.listeners, iteration=self._iteration,
                               total_batches=total_batches(data, epochs - start.epoch),
                               progress=self.loop.progress,
                               report_score=self.loop.report_score_after_averaging)
        plan = FitPlan(data, epochs, start, self.workers, self.loop,
                       batches_are_pairs=self._spec.step_fn is None,
                       accumulate=self.steps.accumulate,
                       recovering=self.faults.max_failures > 0)
        self._checkpoints.reset()
        return FitRun(plan, pool, tracker, self._checkpoints, self.listeners,
                      self._user_optimizer, layout=self._pool_layout)

    def _failed(self, error: BaseException, tracker: RoundTracker) -> None:
        """A fit failed: the workers go (the next fit starts new ones); a worker's error
        names the batch it trained on, and the listeners hear of it."""
        self._mirror = None
        if self._pool is not None:
            if isinstance(error, Exception) and not isinstance(error, WorkerError):
                # The workers are well (a bad batch, a listener raised): they skip the rounds
                # queued and stop, with the messages they are reading taken in whole (killed
                # mid-read, they leave this process's descriptor server tracebacks).
                with contextlib.suppress(Exception):
                    self._pool.halt()
                    self._pool.close(timeout_s=_WELL_CLOSE_S)
            self._pool.kill()
            self._pool = None
        if isinstance(error, WorkerError):
            if where := tracker.batch_of(error.batch, error.worker):
                error.args = (f"{error.args[0]}\n(at {where})",)
            for listener in self.listeners:
                listener.on_worker_failure(error.worker, error, False)

    def _start_position(self, resume_from: str | Path | None, initial_epoch: int) -> Start:
        if resume_from is None:
            return Start(epoch=initial_epoch)
        ckpt = TrainingCheckpoint.load(resume_from)
        ckpt.check(self.fingerprint(), resume_from)
        ckpt.check_schedule(self.steps.lr_scheduler is not None, resume_from)
        self._iteration = ckpt.iteration
        self._checkpoints.run = ckpt.run or self._checkpoints.run  # the same run goes on
        return Start(ckpt.epoch, ckpt.batch, ckpt.data_rng, ckpt.replicas)

    def fingerprint(self) -> dict[str, Any]:
        """What a checkpoint must match to be resumed by this wrapper."""
        fingerprint = {
            "model": type(self.model).__qualname__,
            "parameters": [[k, list(v.shape)]
                           for k, v in tensors_of(self.model.state_dict()).items()],
            "workers": self.workers, "training_mode": self.synchronizer.name,
            "synchronizer": self.synchronizer.config(), "precision": self.precision}
        if self.steps.accumulate > 1:  # absent at 1: older checkpoints still match
            fingerprint["accumulate"] = self.steps.accumulate
        if self._epoch_batches is not None:  # a position in an epoch of other data is another
            fingerprint["batches_per_epoch"] = self._epoch_batches
        spec = self._spec.optimizer
        if spec.cls is not None:  # a factory's optimizer is known only once it is built
            fingerprint["optimizer"] = spec.cls.__qualname__
            fingerprint["optimizer_param_groups"] = [len(g["params"]) for g in spec.groups]
        return fingerprint

    def live_stats(self) -> dict[str, Any]:
        """Live counters of the running fit(): batches, samples, seconds, total batches."""
        if self._tracker is None:
            return {"batches": 0, "samples": 0, "seconds": 0.0, "total_batches": None}
        t = self._tracker
        return {"batches": t.batches, "samples": t.rows, "seconds": t.seconds,
                "total_batches": t.bar.total}

    def _finish(self, run: FitRun) -> ReplicaResult:
        """Rank 0's result; the fit's ``stats()`` from the tracker and every worker."""
        result, per_worker = run.finish()
        tracker = run.tracker
        self._stats = FitStats(
            **tracker.summary(), model_sent=run.sent.model, optimizer_state_sent=run.sent.optimizer,
            workers=self.workers, failures=len(tracker.recoveries),
            seconds_lost=tracker.seconds_lost(), mode=self.synchronizer.name,
            per_worker=per_worker,
            bytes_sent_per_step=[w.get("bytes_sent_per_step", 0.0) for w in per_worker],
            parent_cpu_seconds_per_round=run.parent_cpu_s / max(1, tracker.next_round),
            compile_seconds=max((w.get("compile_seconds", 0.0) for w in per_worker),
                                default=0.0))
        return result

    def _adopt(self, result: ReplicaResult, settings_sent: list[dict[str, Any]]) -> None:
        """Load rank 0's final parameters (and optimizer state) into the user's objects."""
        if result.state is None:
            raise WorkerError("worker 0 finished without sending the trained parameters",
                              worker=0)
        with torch.no_grad():
            load_model_state(self.model, resolve_precision(self.precision).keep_untrained(
                self.model, result.state))
        user_opt = self._user_optimizer
        if user_opt is not None and result.optimizer_state is not None:
            # Settings a listener changed after the replicas last took them (a scheduler
            # stepped in the last on_epoch_end) stay the user's: they apply from the next fit.
            mine = hyperparameters(user_opt)
            kept = changed_settings(mine, settings_sent)
            try:
                load_state_copying(user_opt, trained_state(user_opt, result.optimizer_state))
            except (ValueError, KeyError) as e:
                warn(
                    "the trained optimizer state was not copied back into your "
                    f"{type(user_opt).__name__} ({type(e).__name__}: {e}); it keeps the state "
                    "it had before the fit")
            for group, key in kept:
                if group < len(user_opt.param_groups) and key in mine[group]:
                    user_opt.param_groups[group][key] = mine[group][key]

    def stats(self) -> FitStats:
        """Counters of the last fit(): rounds, samples, samples/s, bytes sent per step (see
        ``FitStats``), a copy each call; empty before the first fit completes."""
        if self._stats is None:
            return cast(FitStats, {})  # no fit yet: no counters
        return copy.deepcopy(self._stats)


def _synchronizer(training_mode: str | TrainingMode | Synchronizer | None,
                  sharing: SharingRecipe | None, options: dict[str, Any]) -> Synchronizer:
    """The synchronizer for ``training_mode`` (default "averaging") with the mode's options;
    ``sharing`` implies, and configures, "shared_gradients"."""
    if sharing is None:
        return build_synchronizer(
            TrainingMode.AVERAGING if training_mode is None else training_mode, **options)
    from paraloom.sync.sharing import SharingRecipe

    if not isinstance(sharing, SharingRecipe):
        raise TypeError(f"sharing={sharing!r}; expected a SharingRecipe(...), e.g. "
                        f"SharingRecipe(threshold_algorithm=QuantileThreshold(1/100))")
    mode = training_mode.value if isinstance(training_mode, TrainingMode) else training_mode
    if mode not in (None, "shared_gradients"):
        raise TypeError(f"sharing= configures training_mode='shared_gradients'; got "
                        f"training_mode={training_mode!r}: leave training_mode out, or drop "
                        f"sharing=")
    if "recipe" in options:
        raise TypeError("recipe= and sharing= were both given; expected one: "
                        "sharing=SharingRecipe(preset=...)")
    return build_synchronizer("shared_gradients", recipe=sharing, **options)

