"""Calling a model on a batch's inputs and a loss on its outputs, as every part of paraloom does."""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from paraloom.data import describe

__all__ = ["LossFn", "batch_total", "forward", "compute_loss"]

LossFn = Callable[[Any, Any], torch.Tensor] | Sequence[Callable[[Any, Any], torch.Tensor]]
"""``loss_fn(outputs, targets) -> loss``, or one such loss per model output (summed)."""


def forward(model: nn.Module, inputs: Any) -> Any:
    """Call the model on a tensor or a PackedSequence (one input), a tuple/list (positional
    inputs) or a mapping (keyword inputs: a dict, a tokenizer's BatchEncoding)."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)) and not isinstance(inputs, PackedSequence):
        return model(*inputs)
    return model(inputs)


def compute_loss(loss_fn: LossFn, outputs: Any, targets: Any) -> torch.Tensor:
    """``loss_fn(outputs, targets)``; a sequence of losses is applied per output and summed
    (a dict of outputs in its order, against a tuple of targets in the same order, or a dict
    of targets under the same keys). ``TypeError`` where the model returned no tensor: None,
    a Python number or a NumPy array."""
    _check_outputs(outputs)
    if isinstance(loss_fn, Sequence) and not isinstance(loss_fn, nn.Module):
        returned = outputs
        if isinstance(outputs, Mapping):
            if isinstance(targets, Mapping):  # paired by key, not by order
                if set(targets) != set(outputs):
                    raise ValueError(f"the model's outputs {sorted(outputs)} and the targets "
                                     f"{sorted(targets)} have other keys; give one target "
                                     "per output, under its key")
                targets = tuple(targets[k] for k in outputs)
            outputs = tuple(outputs.values())
        if not isinstance(outputs, (tuple, list)) or len(outputs) != len(loss_fn):
            raise ValueError(f"{len(loss_fn)} loss functions were given but the model returned "
                             f"{describe(returned)}; give one loss per output")
        _check_per_output_targets(targets, len(loss_fn), returned)
        losses = [f(o, t) for f, o, t in zip(loss_fn, outputs, targets, strict=True)]
        return functools.reduce(operator.add, losses)
    loss: torch.Tensor = loss_fn(outputs, targets)
    return loss


def _check_per_output_targets(targets: Any, count: int, outputs: Any) -> None:
    """Refuse targets that are not one per output for a sequence of ``count`` losses: a single
    tensor would be split along its rows (each loss given a row of it) instead of being each
    output's target."""
    if isinstance(targets, (tuple, list)) and len(targets) == count:
        return
    if isinstance(targets, Mapping):  # and the outputs are not: nothing to pair the keys with
        fix = (f"return a dict from forward (keys {sorted(targets)}) or give the targets as a "
               "tuple in the outputs' order")
    else:
        fix = ("give a tuple of targets in the outputs' order (the same tensor for outputs "
               "that share a target: (y, y)), a dict under the outputs' keys, or one loss_fn "
               "that takes all the outputs")
    raise ValueError(f"{count} loss functions were given, one per output of "
                     f"{describe(outputs)}, but the targets are {describe(targets)}: {fix}")


def _check_outputs(outputs: Any) -> None:
    """Refuse what a model's forward returned where it cannot have gradients to train from."""
    if outputs is None:
        got, fix = "None", "return its output (did forward miss a return?)"
    elif isinstance(outputs, (bool, int, float)):
        got = f"a {type(outputs).__name__}"
        fix = "return the tensor itself, not .item() or float() of it"
    elif type(outputs).__module__ == "numpy":
        got = f"a numpy.{type(outputs).__name__}"
        fix = "return the tensor itself, not .numpy() of it (NumPy arrays have no gradient)"
    else:
        return
    raise TypeError(f"the model's forward returned {got}, where the loss needs a tensor (or a "
                    f"tuple, list or dict of them): {fix}")


def batch_total(loss_fn: Any, rows: int) -> Any:
    """``loss_fn`` made to return its batch's loss summed over the ``rows`` (each of a sequence
    of per-output losses alike): a ``reduction="sum"`` loss as it is, a mean times ``rows``, and
    a ``reduction="none"`` loss's mean times ``rows``. Summed over batches and divided by every
    row, it is the mean loss per row, whatever the batch sizes and the loss's reduction."""
    if isinstance(loss_fn, Sequence) and not isinstance(loss_fn, nn.Module):
        return [batch_total(f, rows) for f in loss_fn]
    summed = getattr(loss_fn, "reduction", "mean") == "sum"

    def total(outputs: Any, targets: Any) -> torch.Tensor:
        value = torch.as_tensor(loss_fn(outputs, targets))
        if summed and value.dim() == 0:
            return value
        return value.mean() * rows

    return total
