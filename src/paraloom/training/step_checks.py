"""What a training step is told when it cannot train: a loss that is not a scalar tensor with
a gradient, inputs of the wrong dtype, a model whose outputs the loss does not take, a setup
with no loss at all. Each error says what came and what to change."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from paraloom._warnings import warn
from paraloom.data import batch_size, describe, iter_tensors, split_batch
from paraloom.forward import LossFn

__all__ = ["LABEL_OUTSIDE", "BatchError", "NonFiniteLossError", "StepFn", "batch_error",
           "check_fit", "checked_loss", "non_finite_loss", "raise_if_dtype_differs",
           "refuse_one_shot", "require_loss", "warn_if_trained"]

StepFn = Callable[[nn.Module, Any], torch.Tensor]
"""``step_fn(model, batch) -> loss``: the user's own forward and loss."""


class NonFiniteLossError(FloatingPointError):
    """The loss of a batch was NaN or infinite."""


class BatchError(RuntimeError):
    """The model or the loss failed on a batch; the message describes the batch."""


def require_loss(loss_fn: LossFn | None, step_fn: StepFn | None) -> None:
    """Refuse a training setup that has no way to compute a loss, or two."""
    if loss_fn is None and step_fn is None:
        raise ValueError("give loss_fn= (e.g. nn.CrossEntropyLoss()) or step_fn=(model, batch)"
                         " -> loss")
    if loss_fn is not None and step_fn is not None:
        raise ValueError("give loss_fn= or step_fn=, not both: step_fn(model, batch) computes "
                         "the loss itself, so loss_fn would never be called")
    losses = list(loss_fn) if isinstance(loss_fn, list | tuple) else [loss_fn or step_fn]
    name = "loss_fn" if loss_fn is not None else "step_fn"
    wrong = [f for f in losses if not callable(f)]
    if wrong:
        raise TypeError(f"{name}={repr(wrong[0])[:60]} is not callable; expected a function or "
                        "module such as nn.CrossEntropyLoss() (loss_fn, or a list of them: one "
                        "per model output) or step_fn=(model, batch) -> loss")
    classes = [f for f in losses if isinstance(f, type) and issubclass(f, torch.nn.Module)]
    if classes:
        raise TypeError(f"{name}={classes[0].__name__} is a class, not a loss: pass an instance, "
                        f"{name}={classes[0].__name__}() (with its options, if any)")


def check_fit(model: nn.Module, epochs: int, initial_epoch: int, resume_from: object) -> None:
    """Refuse fit()'s epochs, an initial epoch beside a checkpoint, or a model with nothing to
    train, before workers start (``ValueError`` naming the fix)."""
    if not isinstance(epochs, int) or isinstance(epochs, bool) or epochs < 1:
        raise ValueError(f"epochs={epochs!r}; expected an int >= 1")
    if not isinstance(initial_epoch, int) or isinstance(initial_epoch, bool) or \
            not 0 <= initial_epoch < epochs:
        raise ValueError(f"initial_epoch={initial_epoch!r}; expected 0 <= initial_epoch < "
                         f"epochs={epochs}")
    if initial_epoch and resume_from is not None:
        raise ValueError(f"initial_epoch={initial_epoch} with resume_from=: the checkpoint "
                         "says where the run stands; give one or the other")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"{type(model).__name__} has no parameter with requires_grad=True: "
                         "there is nothing to train; unfreeze the parameters to train "
                         "(p.requires_grad_(True))")


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


def checked_loss(loss: object, source: str) -> torch.Tensor:
    """``loss``, once it is a scalar tensor that backward can run from; else ``TypeError``,
    saying what ``source`` (``loss_fn`` or ``step_fn``) returned instead and how to fix it."""
    if isinstance(loss, torch.Tensor) and loss.dim() == 0:
        if not loss.requires_grad and torch.is_grad_enabled():
            raise TypeError(f"the loss {source} returned does not require grad: it was "
                            "computed outside autograd (under torch.no_grad(), from .detach() "
                            "or .item() values, or with every parameter frozen); return the "
                            "loss as computed from the model's outputs")
        return loss
    if isinstance(loss, torch.Tensor):
        fix = "reduce it with .mean() or use a reduction='mean' loss"
    elif loss is None:
        fix = f"{source} must return the loss tensor (did it miss a return?)"
    elif isinstance(loss, (int, float)):
        fix = "a Python number has no gradient: return the loss tensor itself, not loss.item()"
    else:
        fix = f"{source} must return one scalar tensor"
    got = "None" if loss is None else describe(loss)
    raise TypeError(f"the loss must be a scalar tensor; {source} returned {got}: {fix}")


def non_finite_loss(value: float, batch: Any) -> NonFiniteLossError:
    """The error for a loss of ``value`` (NaN or infinite) on ``batch``: a batch of no rows
    (whose mean is NaN) is named as such, any other gets the usual remedies."""
    try:
        rows = batch_size(split_batch(batch, training=True)[0])
    except (TypeError, ValueError):  # a batch only a step_fn understands
        rows = None
    if rows == 0:
        return NonFiniteLossError(
            f"the loss is {value} on a batch of 0 rows ({describe(batch)}): a mean over no "
            "rows; the data gave an empty batch (a collate_fn or sampler that drops samples, "
            "a Dataset of length 0 in a ConcatDataset): leave empty batches out")
    return NonFiniteLossError(
        f"the loss is {value} on a batch of {describe(batch)}: lower the learning rate, "
        "check the data for NaN/inf, or clip gradients (gradient_clip_val=1.0)")


def widened(loss: torch.Tensor) -> torch.Tensor:
    """``loss`` in float32 at least: a half-precision loss (fp16, bf16) is widened, so that
    accumulation's ``1/k`` and the reported value keep float32's precision; a float64 loss
    stays float64 (narrowing it would scale a float64 model's gradients by float32's ``1/k``)."""
    return loss if loss.dtype == torch.float64 else loss.float()


LABEL_OUTSIDE = "A class label is outside the model's"
"""How ``batch_error`` begins its fix for a label past the model's classes (Spark's hint for
it looks for this)."""

_PREDICTING = object()
"""``batch_error``'s targets for a batch scored without targets (predictions)."""


def batch_error(e: Exception, inputs: Any, targets: Any = _PREDICTING, outputs: Any = None,
                loss_fn: LossFn | None = None) -> BatchError:
    """``e``, raised by the model or the loss on a batch, with the batch described (without
    ``targets``: a batch being predicted); where a linear layer got inputs of another width,
    the two widths; where the loss failed on a model's several outputs (``outputs``) with one
    ``loss_fn``, how to give one loss per output."""
    message = (f"{type(e).__name__}: {e}\n(on a batch with inputs {describe(inputs)}"
               + ("" if targets is _PREDICTING else f" and targets {describe(targets)}") + ")")
    widths = re.search(r"mat1 and mat2 shapes cannot be multiplied \(\d+x(\d+) and (\d+)x", str(e))
    if widths and outputs is None and isinstance(inputs, torch.Tensor) and inputs.dim() == 1:
        message += (f"\nThe inputs are 1-D, {inputs.shape[0]} rows of one value each (a scalar "
                    "column), which a linear layer takes as one row of that many: give them "
                    "as (rows, 1) (features=[name] on Spark, x.unsqueeze(1) in a Dataset)")
    elif widths and outputs is None:
        message += (f"\nA linear layer got rows of {widths.group(1)} values where it takes "
                    f"{widths.group(2)}: if it is the model's first layer, check the features "
                    "it is given (their columns, or their shape) against its inputs")
    elif isinstance(outputs, tuple | list | Mapping) and callable(loss_fn):
        message += (f"\nThe model returned {describe(outputs)}: give one loss per output "
                    f"(loss_fn=[loss_a, loss_b, ...]; their sum is trained) or a step_fn that "
                    f"computes the loss")
    elif re.search(r"Target -?\d+ is out of bounds", str(e)) and isinstance(outputs,
                                                                           torch.Tensor):
        message += (f"\n{LABEL_OUTSIDE} {outputs.shape[-1]} classes "
                    f"(0 to {outputs.shape[-1] - 1}): check the labels' range, or give the "
                    "model as many outputs as there are classes")
    elif _holds_numpy(inputs):
        message += ("\nThe inputs are NumPy arrays, which a torch model does not take: give "
                    "tensors (torch.as_tensor(x) in the data), or a DataLoader, whose collation "
                    "turns arrays into tensors")
    elif "Expected more than 1 value per channel when training" in str(e):
        message += ("\nA minibatch of one row reached BatchNorm in training: the last minibatch "
                    "of an epoch (or of a Spark partition's share) can be that short; drop it "
                    "(DataLoader(..., drop_last=True), or drop_last=True on the Spark master)")
    return BatchError(message)


def _holds_numpy(obj: object) -> bool:
    """Whether a batch structure has a NumPy array (or scalar) among its leaves."""
    if isinstance(obj, (tuple, list)):
        return any(_holds_numpy(o) for o in obj)
    if isinstance(obj, Mapping):
        return any(_holds_numpy(o) for o in obj.values())
    return type(obj).__module__ == "numpy"


def raise_if_dtype_differs(parameters: Iterable[torch.Tensor], inputs: Any,
                           failure: Exception) -> None:
    """Raise ``TypeError`` naming the conversion when an input's dtype differs from the
    parameters' (the likely cause of ``failure``, the forward pass's error): a float input
    always, an integer one where ``failure`` is about dtypes (an embedding takes integers)."""
    want = next((p.dtype for p in parameters if p.is_floating_point()), None)
    integers_too = "dtype" in str(failure) or "scalar type" in str(failure)
    for t in iter_tensors(inputs):
        if want is None or t.dtype == want:
            continue
        if t.is_floating_point():
            raise TypeError(f"the inputs are {_dtype_name(t.dtype)} but the model's "
                            f"parameters are {_dtype_name(want)}: convert the data "
                            f"(x{_conversion(want)}) or the model "
                            f"(model{_conversion(t.dtype)}){_precision_hint(t.dtype)}"
                            ) from failure
        if integers_too and not t.is_complex() and t.dtype != torch.bool:
            raise TypeError(f"the inputs are {_dtype_name(t.dtype)} but the model's "
                            f"parameters are {_dtype_name(want)}: convert the data "
                            f"(x{_conversion(want)}, e.g. in the Dataset)") from failure


def refuse_one_shot(kind: str, epochs: int) -> None:
    """A one-shot iterator (a generator) gives one epoch: refuse more before workers start."""
    if epochs > 1:
        raise ValueError(f"data is a one-shot {kind}, which yields its batches once, but "
                         f"fit() asks for {epochs} epochs: pass a re-iterable source (a "
                         "DataLoader or a list), or epochs=1")


def warn_if_trained(done: int, epochs: int) -> None:
    """Warn when a resumed checkpoint has trained ``done`` whole epochs, every epoch that
    fit(epochs=...) asks for: the fit then trains nothing."""
    if done >= epochs:
        warn(f"resume_from's checkpoint is of {done} whole epochs, as many as "
             f"fit(epochs={epochs}) asks for or more: nothing is left to train, and the "
             "model gets the checkpoint's state; epochs counts every epoch, those "
             f"before the checkpoint too (fit(epochs={done + 1}) trains one more)")
