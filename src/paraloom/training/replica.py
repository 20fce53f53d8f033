"""One replica: a model copy on a device with its optimizer, and one training step."""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from paraloom.clipping import GradientClipping
from paraloom.data import cpu_copy, describe, iter_tensors, map_tensors, split_batch, to_device
from paraloom.forward import LossFn, compute_loss, forward
from paraloom.precision import Precision, resolve_precision
from paraloom.sync.base import StepContext, Synchronizer
from paraloom.training.messages import ModelState, ReplicaState
from paraloom.training.optim import OptimizerSpec

__all__ = ["Replica", "NonFiniteLossError", "BatchError", "LossFn", "SchedulerFactory", "StepFn",
           "require_loss", "host_to_device"]

StepFn = Callable[[nn.Module, Any], torch.Tensor]
"""``step_fn(model, batch) -> loss``: the user's own forward and loss."""


class NonFiniteLossError(FloatingPointError):
    """The loss of a batch was NaN or infinite."""


class BatchError(RuntimeError):
    """The model or the loss failed on a batch; the message describes the batch."""


def require_loss(loss_fn: LossFn | None, step_fn: StepFn | None) -> None:
    """Refuse a training setup that has no way to compute a loss."""
    if loss_fn is None and step_fn is None:
        raise ValueError("give loss_fn= (e.g. nn.CrossEntropyLoss()) or step_fn=(model, batch)"
                         " -> loss")


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


_CONVERSIONS = {torch.float32: ".float()", torch.float64: ".double()",
                torch.float16: ".half()", torch.bfloat16: ".bfloat16()"}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _conversion(dtype: torch.dtype) -> str:
    """The tensor/module method that converts to ``dtype`` (e.g. ``.bfloat16()``)."""
    return _CONVERSIONS.get(dtype, f".to(torch.{_dtype_name(dtype)})")


def _precision_hint(dtype: torch.dtype) -> str:
    """For half-precision inputs: the precision= that runs the model in that dtype."""
    name = {torch.float16: "16", torch.bfloat16: "bf16"}.get(dtype)
    return f", or train with precision=\"{name}-true\"" if name else ""


SchedulerFactory = Callable[[torch.optim.Optimizer], LRScheduler]
"""``lr_scheduler(optimizer) -> scheduler``, e.g. ``lambda opt: OneCycleLR(opt, 0.1, 1000)``."""


def _build_scheduler(factory: SchedulerFactory, optimizer: torch.optim.Optimizer) -> LRScheduler:
    scheduler = factory(optimizer)
    if not isinstance(scheduler, LRScheduler):
        raise TypeError(f"lr_scheduler returned {type(scheduler).__name__}; expected a "
                        f"torch.optim.lr_scheduler.LRScheduler built on the optimizer it is "
                        f"given (e.g. lambda opt: OneCycleLR(opt, max_lr=0.1, total_steps=N)). "
                        f"ReduceLROnPlateau needs a metric: step it in a listener")
    if scheduler.optimizer is not optimizer:
        raise ValueError("lr_scheduler built its scheduler on another optimizer; expected one "
                         "on the optimizer it is given: lambda opt: StepLR(opt, ...)")
    return scheduler


def _grad_scaler(precision: Precision, device: torch.device) -> torch.amp.GradScaler | None:
    """fp16 autocast needs loss scaling against gradient underflow; bf16 and -true do not."""
    if precision.autocast_dtype is not torch.float16:
        return None
    return torch.amp.GradScaler(device.type)


class Replica:
    """A private copy of the model and its optimizer on one device, kept in sync by ``sync``."""

    def __init__(self, model: nn.Module, optimizer: OptimizerSpec, *,
                 loss_fn: LossFn | None = None, step_fn: StepFn | None = None,
                 synchronizer: Synchronizer, device: torch.device | str = "cpu",
                 group: dist.ProcessGroup | None = None, rank: int = 0, world_size: int = 1,
                 precision: str | Precision = "32-true",
                 clipping: GradientClipping | None = None,
                 lr_scheduler: SchedulerFactory | None = None) -> None:
        require_loss(loss_fn, step_fn)
        self.device = torch.device(device)
        self.precision = resolve_precision(precision)
        self.precision.check_device(self.device)
        # A deep copy: a model that crossed a process boundary may share storage with others.
        self.model = self.precision.convert_module(copy.deepcopy(model).to(self.device))
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
        self.loss_computed: Callable[[], None] | None = None
        """Called once a step's own work is done (its loss computed, or an idle round begun),
        before the collectives: the pool tells a hung worker from peers that wait for it."""

    def begin_fit(self, state: ModelState | None, resume: ReplicaState | None = None,
                  optimizer_state: dict[str, Any] | None = None, seed: int | None = None,
                  hyperparameters: list[dict[str, Any]] | None = None) -> None:
        """Load the user's parameters and optimizer state (or this replica's state from a
        checkpoint; None: keep what this replica holds), seed the replica's RNG, and set up the
        synchronizer."""
        self._rng = None  # a fresh fit's seed wins over an earlier fit's restored RNG
        if state is not None:
            self.model.load_state_dict(state)
        if optimizer_state is not None:
            # A private copy: what arrived from the parent lives in memory shared with the
            # other replicas, and load_state_dict keeps same-device tensors as they are.
            self.optimizer.load_state_dict(copy.deepcopy(optimizer_state))
        elif hyperparameters is not None:
            self.set_hyperparameters(hyperparameters)
        if seed is not None:
            torch.manual_seed(seed)
        self.ctx.step = 0
        # A fresh schedule per fit(), from the param groups' initial_lr (a scheduler keeps it),
        # before a resumed state replaces where it stands.
        self.scheduler = None if self.lr_scheduler is None else \
            _build_scheduler(self.lr_scheduler, self.optimizer)
        if resume is not None:
            self._restore(resume)
        self.sync.setup(self.ctx)
        if resume is not None:
            self.sync.load_state_dict(resume["sync"])
        self._module = self.sync.wrap_model(self.model, self.ctx)

    def set_hyperparameters(self, hyperparameters: list[dict[str, Any]]) -> None:
        """Set each param group's settings (lr, momentum, ...) to the user's."""
        groups = self.optimizer.param_groups
        if len(groups) != len(hyperparameters):
            raise ValueError(f"the optimizer has {len(hyperparameters)} param groups but the "
                             f"replicas' has {len(groups)}: add param groups before the first "
                             "fit(), or pass an optimizer factory")
        for group, settings in zip(groups, hyperparameters, strict=True):
            group.update(copy.deepcopy(settings))

    def step(self, batch: Any | None) -> float | None:
        """Train on one batch (None: an idle round); returns the batch's loss."""
        ctx = self.ctx
        if self._rng is not None:  # restored lazily: with workers=1 the caller shares the RNG
            torch.set_rng_state(self._rng)
            self._rng = None
        if batch is None:
            if self.loss_computed is not None:
                self.loss_computed()
            self.sync.idle_step(ctx)
            self._step_scheduler()
            ctx.step += 1
            return None
        self.sync.before_step(ctx)
        try:
            value = self._train_step(batch)
        except BaseException:
            self.sync.abort_step(ctx)
            raise
        self.sync.after_step(ctx)
        self._step_scheduler()
        ctx.step += 1
        return value

    def _train_step(self, batch: Any) -> float:
        """Forward, backward and optimizer step on one batch; returns the batch's loss."""
        ctx = self.ctx
        self.optimizer.zero_grad(set_to_none=True)
        loss = self._loss(batch)
        if self.loss_computed is not None:
            self.loss_computed()
        value = float(loss.detach())
        if not math.isfinite(value):
            raise NonFiniteLossError(
                f"the loss is {value} on a batch of {describe(batch)}: lower the learning rate, "
                "check the data for NaN/inf, or clip gradients (gradient_clip_val=1.0)")
        scaled = self.scaler.scale(loss) if self.scaler else loss
        scaled.backward()  # type: ignore[no-untyped-call]
        ctx.skip_optimizer_step = False
        self.sync.after_backward(ctx)
        if not ctx.skip_optimizer_step:
            ctx.clip_gradients()
        if self.scaler is not None:
            if not ctx.skip_optimizer_step:
                self.scaler.step(self.optimizer)
            self.scaler.update()
        elif not ctx.skip_optimizer_step:
            self.optimizer.step()
        return value

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
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise TypeError(f"the loss must be a scalar tensor; got {describe(loss)}. "
                            "Reduce it with .mean() or use a reduction='mean' loss")
        return loss.float()

    def _model_loss(self, batch: Any) -> torch.Tensor:
        assert self.loss_fn is not None  # require_loss: no step_fn means a loss_fn
        inputs, targets = split_batch(batch)
        self._check_dtype(inputs)
        try:
            outputs = forward(self._module, inputs)
            return compute_loss(self.loss_fn, outputs, targets)
        except Exception as e:
            raise BatchError(f"{type(e).__name__}: {e}\n(on a batch with inputs "
                             f"{describe(inputs)} and targets {describe(targets)})") from e

    def _check_dtype(self, inputs: Any) -> None:
        want = next((p.dtype for p in self.model.parameters() if p.is_floating_point()), None)
        for t in iter_tensors(inputs):
            if want is not None and t.is_floating_point() and t.dtype != want:
                raise TypeError(f"the inputs are {_dtype_name(t.dtype)} but the model's "
                                f"parameters are {_dtype_name(want)}: convert the data "
                                f"(x{_conversion(want)}) or the model "
                                f"(model{_conversion(t.dtype)}){_precision_hint(t.dtype)}")

    def finish(self) -> None:
        """End of fit(): the synchronizer makes every replica hold the same parameters."""
        self.sync.finish(self.ctx)

    def model_state(self) -> ModelState:
        """Independent CPU copies of the parameters (the values every replica agrees on) and
        buffers."""
        shared = self.sync.shared_parameters(self.ctx)
        live = self.model.state_dict(keep_vars=True)
        state: ModelState = cpu_copy({name: shared.get(id(t), t).detach()
                                      for name, t in live.items()})
        return state

    def full_state(self) -> ReplicaState:
        """Everything needed to continue this replica exactly: weights, optimizer, sync, RNG;
        as independent CPU copies (CUDA memory must not outlive its process in another)."""
        snap: ReplicaState = {
            "model": self.model_state(), "optimizer": cpu_copy(self.optimizer.state_dict()),
            "sync": cpu_copy(self.sync.state_dict()), "step": self.ctx.step,
            "rng": torch.get_rng_state()}
        if self.device.type == "cuda":
            snap["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        if self.scaler is not None:
            snap["scaler"] = self.scaler.state_dict()
        if self.scheduler is not None:
            snap["scheduler"] = self.scheduler.state_dict()
        return snap

    def _restore(self, snap: ReplicaState) -> None:
        self.model.load_state_dict(snap["model"])
        self.optimizer.load_state_dict(copy.deepcopy(snap["optimizer"]))
        self.ctx.step = int(snap["step"])
        self._rng = snap["rng"]
        if "cuda_rng" in snap and self.device.type == "cuda":
            torch.cuda.set_rng_state(snap["cuda_rng"], self.device)
        if self.scaler is not None and "scaler" in snap:
            self.scaler.load_state_dict(snap["scaler"])
        if self.scheduler is not None and "scheduler" in snap:
            self.scheduler.load_state_dict(snap["scheduler"])
