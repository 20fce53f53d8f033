"""One replica: a model copy on a device with its optimizer, and one training step."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from paraloom.data import cpu_copy, describe, iter_tensors, map_tensors, split_batch, to_device
from paraloom.precision import Precision, resolve_precision
from paraloom.sync.base import StepContext, Synchronizer
from paraloom.training.optim import OptimizerSpec

__all__ = ["Replica", "NonFiniteLossError", "BatchError", "forward"]

StepFn = Callable[[nn.Module, Any], torch.Tensor]


class NonFiniteLossError(FloatingPointError):
    """The loss of a batch was NaN or infinite."""


class BatchError(RuntimeError):
    """The model or the loss failed on a batch; the message describes the batch."""


def forward(model: nn.Module, inputs: Any) -> Any:
    """Call the model on a tensor, a tuple/list (positional inputs) or a dict (keyword inputs)."""
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def compute_loss(loss_fn: Any, outputs: Any, targets: Any) -> torch.Tensor:
    """``loss_fn(outputs, targets)``; a sequence of losses is applied per output and summed."""
    if isinstance(loss_fn, Sequence) and not isinstance(loss_fn, nn.Module):
        if not isinstance(outputs, (tuple, list)) or len(outputs) != len(loss_fn):
            raise ValueError(f"{len(loss_fn)} loss functions were given but the model returned "
                             f"{describe(outputs)}; give one loss per output")
        return sum(f(o, t) for f, o, t in zip(loss_fn, outputs, targets, strict=True))
    return loss_fn(outputs, targets)


def _grad_scaler(precision: Precision, device: torch.device) -> Any:
    """fp16 autocast needs loss scaling against gradient underflow; bf16 and -true do not."""
    if precision.autocast_dtype is not torch.float16:
        return None
    return torch.amp.GradScaler(device.type)


class Replica:
    """A private copy of the model and its optimizer on one device, kept in sync by ``sync``."""

    def __init__(self, model: nn.Module, optimizer: OptimizerSpec, *,
                 loss_fn: Any = None, step_fn: StepFn | None = None,
                 synchronizer: Synchronizer, device: torch.device | str = "cpu",
                 group: Any = None, rank: int = 0, world_size: int = 1,
                 precision: str | Precision = "32-true") -> None:
        if loss_fn is None and step_fn is None:
            raise ValueError("give loss_fn= (e.g. nn.CrossEntropyLoss()) or step_fn=(model, batch)"
                             " -> loss")
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
                               scaler=self.scaler)
        self._module: nn.Module = self.model
        self._rng: torch.Tensor | None = None

    def begin_fit(self, state: dict[str, torch.Tensor] | None,
                  snapshot: dict[str, Any] | None = None,
                  optimizer_state: dict[str, Any] | None = None, seed: int | None = None) -> None:
        """Load the master parameters and optimizer state (or a checkpoint's replica), seed the
        replica's RNG, and set up the synchronizer."""
        if state is not None:
            self.model.load_state_dict(state)
        if optimizer_state is not None:
            # A private copy: what arrived from the parent lives in memory shared with the
            # other replicas, and load_state_dict keeps same-device tensors as they are.
            self.optimizer.load_state_dict(copy.deepcopy(optimizer_state))
        if seed is not None:
            torch.manual_seed(seed)
        self.ctx.step = 0
        if snapshot is not None:
            self._restore(snapshot)
        self.sync.setup(self.ctx)
        if snapshot is not None:
            self.sync.load_state_dict(snapshot["sync"])
        self._module = self.sync.wrap_model(self.model, self.ctx)

    def step(self, batch: Any | None) -> float | None:
        """Train on one batch (None: an idle round); returns the batch's loss."""
        ctx = self.ctx
        if self._rng is not None:  # restored lazily: with workers=1 the caller shares the RNG
            torch.set_rng_state(self._rng)
            self._rng = None
        if batch is None:
            self.sync.idle_step(ctx)
            ctx.step += 1
            return None
        self.sync.before_step(ctx)
        self.optimizer.zero_grad(set_to_none=True)
        loss = self._loss(batch)
        value = float(loss.detach())
        if not math.isfinite(value):
            raise NonFiniteLossError(
                f"the loss is {value} on a batch of {describe(batch)}: lower the learning rate, "
                "check the data for NaN/inf, or clip gradients")
        (self.scaler.scale(loss) if self.scaler else loss).backward()
        ctx.skip_optimizer_step = False
        self.sync.after_backward(ctx)
        if self.scaler is not None:
            if not ctx.skip_optimizer_step:
                self.scaler.step(self.optimizer)
            self.scaler.update()
        elif not ctx.skip_optimizer_step:
            self.optimizer.step()
        self.sync.after_step(ctx)
        ctx.step += 1
        return value

    def _loss(self, batch: Any) -> torch.Tensor:
        batch = to_device(batch, self.device, non_blocking=True)
        if self.precision.param_dtype is not None:
            batch = map_tensors(batch, self.precision.cast)
        with self.precision.forward_context(self.device):
            if self.step_fn is not None:
                loss = self.step_fn(self._module, batch)
            else:
                loss = self._model_loss(batch)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise TypeError(f"the loss must be a scalar tensor; got {describe(loss)}. "
                            "Reduce it with .mean() or use a reduction='mean' loss")
        return loss.float()

    def _model_loss(self, batch: Any) -> torch.Tensor:
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
                raise TypeError(f"the inputs are {str(t.dtype).removeprefix('torch.')} but the "
                                f"model's parameters are {str(want).removeprefix('torch.')}: "
                                "convert the data (x.float()) or the model (model.double())")

    def finish(self) -> None:
        """End of fit(): the synchronizer makes every replica hold the same parameters."""
        self.sync.finish(self.ctx)

    def state(self) -> dict[str, torch.Tensor]:
        """Independent CPU copies of the parameters and buffers."""
        return cpu_copy(self.model.state_dict())

    def snapshot(self) -> dict[str, Any]:
        """Everything needed to continue this replica exactly: weights, optimizer, sync, RNG."""
        snap = {"model": self.state(), "optimizer": copy.deepcopy(self.optimizer.state_dict()),
                "sync": self.sync.state_dict(), "step": self.ctx.step,
                "rng": torch.get_rng_state()}
        if self.device.type == "cuda":
            snap["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        if self.scaler is not None:
            snap["scaler"] = self.scaler.state_dict()
        return snap

    def _restore(self, snap: dict[str, Any]) -> None:
        self.model.load_state_dict(snap["model"])
        self.optimizer.load_state_dict(copy.deepcopy(snap["optimizer"]))
        self.ctx.step = int(snap["step"])
        self._rng = snap["rng"]
        if "cuda_rng" in snap and self.device.type == "cuda":
            torch.cuda.set_rng_state(snap["cuda_rng"], self.device)
        if self.scaler is not None and "scaler" in snap:
            self.scaler.load_state_dict(snap["scaler"])
