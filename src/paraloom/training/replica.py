"""One replica: a model copy on a device with its optimizer, and one training step."""

from __future__ import annotations

import copy
import math
import time
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from paraloom.clipping import GradientClipping
from paraloom.data import cpu_copy, map_tensors, split_batch, to_device
from paraloom.extra_state import detached_state
from paraloom.forward import LossFn, compute_loss, forward
from paraloom.precision import Precision, resolve_precision
from paraloom.sync.base import StepContext, Synchronizer, zero_loss
from paraloom.training.buffers import load_model_state, load_transient, transient_buffers
from paraloom.training.messages import ModelState, ReplicaState
from paraloom.training.optim import OptimizerSpec
from paraloom.training.parametrized import private_copy
from paraloom.training.schedules import SchedulerFactory, build_scheduler
from paraloom.training.step_checks import (
    BatchError,
    NonFiniteLossError,
    StepFn,
    batch_error,
    checked_loss,
    non_finite_loss,
    raise_if_dtype_differs,
    require_loss,
    widened,
)
from paraloom.training.timing import RoundTiming

__all__ = ["Accumulation", "Replica", "NonFiniteLossError", "BatchError", "LossFn",
           "StepFn", "require_loss", "host_to_device"]

_S = TypeVar("_S")


def host_to_device(batch: Any, device: torch.device) -> Any:
    """A batch on ``device``; CPU tensors bound for a GPU go through pinned memory, so the copy
    is asynchronous (``non_blocking``) as with a DataLoader's ``pin_memory=True``."""
    if device.type != "cuda":
        return to_device(batch, device)

    def move(t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cpu" and not t.is_pinned():
            t = t.pin_memory()
        return t.to(device, non_blocking=True)

    return map_tensors(batch, move)


def _grad_scaler(precision: Precision, device: torch.device) -> torch.amp.GradScaler | None:
    """fp16 autocast needs loss scaling against gradient underflow; bf16 and -true do not."""
    if precision.autocast_dtype is not torch.float16:
        return None
    return torch.amp.GradScaler(device.type)


class Accumulation:
    """Where a replica stands in gradient accumulation: ``size`` rounds per optimizer step."""

    __slots__ = ("size", "rounds", "has_gradients")

    def __init__(self, size: int = 1) -> None:
        self.size = size
        self.rounds = 0
        """Rounds of the accumulation under way taken so far (its step not yet taken)."""
        self.has_gradients = False
        """Gradients of a batch since the last step wait in the parameters' ``.grad``."""

    def reset(self) -> None:
        self.rounds, self.has_gradients = 0, False

    def holds_back(self) -> bool:
        """Count a round: True while it only accumulates, False for the round that steps."""
        if self.rounds + 1 < self.size:
            self.rounds += 1
            return True
        self.rounds = 0
        return False

    def added(self) -> None:
        self.has_gradients = True

    def stepped(self) -> None:
        self.has_gradients = False


class Replica:
    """A private copy of the model and its optimizer on one device, kept in sync by ``sync``."""

    def __init__(self, model: nn.Module, optimizer: OptimizerSpec, *,
                 loss_fn: LossFn | None = None, step_fn: StepFn | None = None,
                 synchronizer: Synchronizer, device: torch.device | str = "cpu",
                 group: dist.ProcessGroup | None = None, rank: int = 0, world_size: int = 1,
                 precision: str | Precision = "32-true",
                 clipping: GradientClipping | None = None,
                 lr_scheduler: SchedulerFactory | None = None, accumulate: int = 1,
                 compile_options: dict[str, Any] | None = None) -> None:
        require_loss(loss_fn, step_fn)
        self.device = torch.device(device)
        self.precision = resolve_precision(precision)
        self.precision.check_device(self.device)
        # A deep copy: a model that crossed a process boundary may share storage with others.
        self.model = self.precision.convert_module(private_copy(model).to(self.device))
        self.model.train()
        self.optimizer = optimizer.build(self.model)
        self.scaler = _grad_scaler(self.precision, self.device)
        self.loss_fn = loss_fn
        self.step_fn = step_fn
        self.sync = synchronizer
        self.ctx = StepContext(model=self.model, optimizer=self.optimizer, group=group,
                               rank=rank, world_size=world_size, device=self.device,
                               scaler=self.scaler, clipping=clipping)
        self._module: nn.Module = self.model
        self.lr_scheduler = lr_scheduler
        self.scheduler: LRScheduler | None = None
        """This fit's ``lr_scheduler(optimizer)``, stepped after every round."""
        self._rng: torch.Tensor | None = None
        self.accumulation = Accumulation(accumulate)
        self.compile_options = compile_options
        self._compiled: nn.Module | None = None
        """``torch.compile(model)`` when compile_options ask for it: the forward runs in it."""
        self._compiled_ran = False
        self.timing = RoundTiming()
        """Seconds in the step and in the synchronizer's hooks, summed over this fit."""
        self.loss_computed: Callable[[], None] | None = None
        """Called once a step's own work is done (its loss computed, or an idle round begun),
        before the collectives: the pool tells a hung worker from peers that wait for it."""

    def begin_fit(self, state: ModelState | None, resume: ReplicaState | None = None,
                  optimizer_state: dict[str, Any] | None = None, seed: int | None = None,
                  hyperparameters: list[dict[str, Any]] | None = None,
                  continue_schedule: bool = False) -> None:
        """Load the user's parameters and optimizer state (or this replica's state from a
        checkpoint; None: keep what this replica holds), seed the replica's RNG, and set up the
        synchronizer. ``continue_schedule``: keep the previous fit's ``lr_scheduler``."""
        self._rng = None  # a fresh fit's seed wins over an earlier fit's restored RNG
        if state is not None:
            load_model_state(self.model, state)
        self.model.train()  # every fit, as Lightning: a step_fn may have left it in eval
        if optimizer_state is not None:
            # A private copy: what arrived from the parent lives in memory shared with the
            # other replicas, and load_state_dict keeps same-device tensors as they are.
            self.optimizer.load_state_dict(copy.deepcopy(optimizer_state))
        elif hyperparameters is not None:
            self.set_hyperparameters(hyperparameters)
        if seed is not None:
            torch.manual_seed(seed)
        self.ctx.step = 0
        self.accumulation.reset()
        self.timing.reset()
        # A fresh schedule per fit(), from the param groups' initial_lr (a scheduler keeps it),
        # before a resumed state replaces where it stands; training driven epoch by epoch
        # goes on with the schedule it stepped so far.
        if not (continue_schedule and self.scheduler is not None):
            if self.lr_scheduler is not None:  # StepLR & co. step from the lr they find
                for group in self.optimizer.param_groups:
                    group["lr"] = group.get("initial_lr", group["lr"])
            self.scheduler = None if self.lr_scheduler is None else \
                build_scheduler(self.lr_scheduler, self.optimizer)
        if resume is not None:
            self._restore(resume)
        self.sync.setup(self.ctx)
        if resume is not None:
            self.sync.load_state_dict(resume["sync"])
        self._module = self.sync.wrap_model(self._forward_model(), self.ctx)

    def _forward_model(self) -> nn.Module:
        """The model the forward runs in: the replica's own, or (``compile_options``) one
        ``torch.compile`` of it for every fit (its parameters are the model's)."""
        if self.compile_options is None:
            return self.model
        if self._compiled is None:
            compiled: nn.Module = torch.compile(self.model, **self.compile_options)  # type: ignore[assignment]
            self._compiled = compiled
        return self._compiled

    def set_hyperparameters(self, hyperparameters: list[dict[str, Any]]) -> None:
        """Set each param group's settings (lr, momentum, ...) to the user's."""
        groups = self.optimizer.param_groups
        if len(groups) != len(hyperparameters):
            raise ValueError(f"the optimizer has {len(hyperparameters)} param groups but the "
                             f"replicas' has {len(groups)}: add param groups between fits, or "
                             "pass an optimizer factory")
        for group, settings in zip(groups, hyperparameters, strict=True):
            group.update(copy.deepcopy(settings))

    def step(self, batch: Any | None) -> float | None:
        """Train on one batch (None: an idle round); returns the batch's loss. With gradient
        accumulation, a round before the last of an accumulation only adds up gradients."""
        self.take_restored_rng()
        if self.accumulation.holds_back():
            return self._accumulate(batch)
        return self._synchronized_step(batch)

    def take_restored_rng(self) -> None:
        """Put a restored checkpoint's RNG state in place, once (lazily, at the first round:
        with workers=1 the caller shares the RNG). The runner calls it before it builds the
        round's batch, whose ``__getitem__`` may draw random numbers (augmentations), as the
        uninterrupted run's did from that state."""
        if self._rng is not None:
            torch.set_rng_state(self._rng)
            self._rng = None

    def end_accumulation(self) -> None:
        """Step on what the rounds since the last step accumulated (an epoch ended)."""
        if self.accumulation.rounds:
            self.accumulation.rounds = 0
            self._synchronized_step(None)

    def _synchronized_step(self, batch: Any | None) -> float | None:
        """The step every replica takes together: the synchronizer's hooks around forward,
        backward (of ``batch``, or of what accumulated) and the optimizer."""
        ctx, accumulated = self.ctx, self.accumulation.has_gradients
        timing, began = self.timing, time.perf_counter()
        if batch is None and not accumulated:
            if self.loss_computed is not None:
                self.loss_computed()
            self.sync.idle_step(ctx)
            timing.sync_s += time.perf_counter() - began
            self._end_step()
            return None
        self.sync.before_step(ctx)
        stepping = time.perf_counter()
        try:
            value = self._train_step(batch)
        except BaseException as e:
            self._abort(e)
            raise
        stepped = time.perf_counter()
        self.sync.after_step(ctx)
        timing.step_s += stepped - stepping
        timing.sync_s += time.perf_counter() - stepped + (stepping - began)
        self._end_step()
        return value

    def _abort(self, error: BaseException) -> None:
        """A step raised: the synchronizer undoes what it began; an error it can say in
        paraloom's terms is raised in those."""
        self.sync.abort_step(self.ctx)
        explained = self.sync.explain(error, self.ctx)
        if explained is not None:
            raise explained from error

    def _end_step(self) -> None:
        self.accumulation.stepped()
        self._step_scheduler()
        self.ctx.step += 1

    def _accumulate(self, batch: Any | None) -> float | None:
        """A round inside an accumulation: forward and backward (no collectives), no step."""
        if batch is None:
            if self.loss_computed is not None:
                self.loss_computed()
            return None
        ctx, began = self.ctx, time.perf_counter()
        self.sync.before_step(ctx)
        try:
            with self.sync.accumulating(ctx):
                value = self._backward(batch)
        except BaseException as e:
            self._abort(e)
            raise
        self.timing.step_s += time.perf_counter() - began
        return value

    def _backward(self, batch: Any | None) -> float | None:
        """Forward and backward of ``batch`` (None: of a zero loss, which takes part in the
        collectives that run in backward), its loss divided by ``accumulate``, the gradients
        added to what the accumulation holds; returns the batch's loss."""
        if not self.accumulation.has_gradients:
            self.optimizer.zero_grad(set_to_none=True)
        began = time.perf_counter()
        compiling = self._compiled is not None and not self._compiled_ran and batch is not None
        loss = self._loss(batch) if batch is not None else self._zero_loss()
        if self.loss_computed is not None:
            self.loss_computed()
        value = float(loss.detach())
        if not math.isfinite(value):
            raise non_finite_loss(value, batch)
        if self.accumulation.size > 1:
            loss = loss / self.accumulation.size
        scaled = self.scaler.scale(loss) if self.scaler else loss
        scaled.backward()  # type: ignore[no-untyped-call]
        self.accumulation.added()
        if compiling:  # torch.compile compiles the forward and backward on their first run
            self._compiled_ran = True
            self.timing.compile_s += time.perf_counter() - began
        return value if batch is not None else None

    def _train_step(self, batch: Any | None) -> float | None:
        """Backward (``_backward``), then the optimizer step; returns the batch's loss."""
        ctx = self.ctx
        value = self._backward(batch)
        ctx.skip_optimizer_step = False
        hook = time.perf_counter()
        self.sync.after_backward(ctx)
        spent = time.perf_counter() - hook  # a hook: step() counts the whole step as step_s
        self.timing.sync_s += spent
        self.timing.step_s -= spent
        if not ctx.skip_optimizer_step:
            ctx.clip_gradients()
        if self.scaler is not None:
            if not ctx.skip_optimizer_step:
                self.scaler.step(self.optimizer)
            self.scaler.update()
        elif not ctx.skip_optimizer_step:
            self.optimizer.step()
        return value

    def _zero_loss(self) -> torch.Tensor:
        """A loss of 0 over every trainable parameter, run as the model's forward (so that a
        synchronizer that all-reduces in backward, DDP, takes part with what accumulated)."""
        loss: torch.Tensor = self.sync.run_step_fn(lambda model, _: zero_loss(model),
                                                   self._module, None, self.ctx)
        return widened(loss)

    def _step_scheduler(self) -> None:
        """One step of the schedule per round, trained or idle: every replica's rate moves alike."""
        if self.scheduler is not None:
            with warnings.catch_warnings():  # an idle first round steps before its optimizer
                warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*")
                self.scheduler.step()

    def _loss(self, batch: Any) -> torch.Tensor:
        batch = host_to_device(batch, self.device)
        if self.precision.param_dtype is not None:
            batch = map_tensors(batch, self.precision.cast)
        with self.precision.forward_context(self.device):
            if self.step_fn is not None:
                loss = self.sync.run_step_fn(self.step_fn, self._module, batch, self.ctx)
            else:
                loss = self._model_loss(batch)
        return widened(checked_loss(loss, "step_fn" if self.step_fn is not None else "loss_fn"))

    def _model_loss(self, batch: Any) -> torch.Tensor:
        assert self.loss_fn is not None  # require_loss: no step_fn means a loss_fn
        inputs, targets = split_batch(batch, training=True)
        try:
            outputs = forward(self._module, inputs)
        except Exception as e:
            # A model may cast its inputs itself: a dtype that differs is named only once the
            # forward pass failed on it.
            raise_if_dtype_differs(self.model.parameters(), inputs, e)
            raise batch_error(e, inputs, targets) from e
        try:
            return compute_loss(self.loss_fn, outputs, targets)
        except Exception as e:
            raise batch_error(e, inputs, targets, outputs, self.loss_fn) from e

    def finish(self) -> None:
        """End of fit(): a step on what is left accumulated (a ``stop()`` in an
        accumulation), then the synchronizer makes every replica hold the same parameters."""
        self.end_accumulation()
        self.sync.finish(self.ctx)

    def model_state(self, independent: bool = True) -> ModelState:
        """CPU copies of the parameters (the values every replica agrees on) and buffers;
        ``independent=False``: a CPU replica's own tensors, for a caller that copies them at
        once."""
        shared = self.sync.shared_parameters(self.ctx)
        live = self.model.state_dict(keep_vars=True)
        state: ModelState = _on_cpu(detached_state(live, shared), independent)
        return state

    def full_state(self, independent: bool = True) -> ReplicaState:
        """Everything needed to continue this replica exactly: weights, optimizer, sync, RNG;
        as independent CPU copies (CUDA memory must not outlive its process in another), or
        (``independent=False``) with a CPU replica's own tensors, for a caller that copies
        them at once (``pack_tensors``)."""
        snap: ReplicaState = {
            "model": self.model_state(independent),
            "optimizer": _on_cpu(self.optimizer.state_dict(), independent),
            "sync": _on_cpu(self.sync.state_dict(), independent), "step": self.ctx.step,
            "rng": torch.get_rng_state()}
        transient = transient_buffers(self.model)
        if transient:  # beside the model's state_dict, which then loads as torch's own
            snap["buffers"] = _on_cpu({k: v.detach() for k, v in transient.items()},
                                      independent)
        if self.device.type == "cuda":
            snap["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        if self.scaler is not None:
            snap["scaler"] = self.scaler.state_dict()
        if self.scheduler is not None:
            snap["scheduler"] = self.scheduler.state_dict()
        if self.accumulation.rounds:  # part way through an accumulation: its gradients
            snap["accumulation"] = {"rounds": self.accumulation.rounds, "grads": [
                None if p.grad is None or not self.accumulation.has_gradients
                else p.grad.detach().cpu().clone() for p in self.model.parameters()]}
        return snap

    def _restore(self, snap: ReplicaState) -> None:
        self.model.load_state_dict(snap["model"])
        load_transient(self.model, snap.get("buffers", {}))
        self.optimizer.load_state_dict(copy.deepcopy(snap["optimizer"]))
        self.ctx.step = int(snap["step"])
        self._rng = snap.get("rng")  # none: the fit set it (Start.taking_shared_rng)
        if "cuda_rng" in snap and self.device.type == "cuda":
            torch.cuda.set_rng_state(snap["cuda_rng"], self.device)
        if self.scaler is not None and "scaler" in snap:
            self.scaler.load_state_dict(snap["scaler"])
        if self.scheduler is not None and "scheduler" in snap:
            self.scheduler.load_state_dict(snap["scheduler"])
        self._restore_accumulation(snap.get("accumulation"))

    def _restore_accumulation(self, saved: dict[str, Any] | None) -> None:
        self.accumulation.reset()
        if saved is None:
            return
        self.accumulation.rounds = int(saved["rounds"])
        for p, grad in zip(self.model.parameters(), saved["grads"], strict=True):
            p.grad = None if grad is None else grad.to(p.device, p.dtype).clone()
            if grad is not None:
                self.accumulation.added()


def _on_cpu(state: _S, independent: bool) -> _S:
    """``state``'s tensors on the CPU: copies, or (not ``independent``) those already there
    as they are."""
    return cpu_copy(state) if independent else to_device(state, torch.device("cpu"))
