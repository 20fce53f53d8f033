"""DiLoCo on Spark, the driver's side: the shared parameters (the anchor) and the outer
optimizer that steps them with the tasks' averaged pseudo-gradients (see ``diloco_task``), and
the sparse update that takes an executor's copy of the last round's shared state to this one's.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from safetensors.torch import save as st_save

from paraloom.extra_state import tensors_of
from paraloom.spark.runtime import flatten
from paraloom.sync.diloco import (
    OuterOptimizer,
    averaging_outer_optimizer,
    check_outer,
    nesterov_outer_optimizer,
)
from paraloom.sync.pseudo_gradients import TopK
from paraloom.training.messages import ModelState

__all__ = ["OuterStep", "resolve_diloco", "state_update", "SPARSE_UPDATE_FRACTION"]

SPARSE_UPDATE_FRACTION = 0.25
"""A round's sparse update is broadcast when it is smaller than this fraction of the full
state's bytes (with the plain outer step only the entries the tasks sent change)."""

_NAMED: dict[str, OuterOptimizer] = {"averaging": averaging_outer_optimizer,
                                     "nesterov": nesterov_outer_optimizer}


def _named(name: str) -> OuterOptimizer:
    if name not in _NAMED:
        raise ValueError(f"outer_optimizer={name!r}; expected a callable taking the parameters "
                         f"or one of {sorted(_NAMED)}")
    return _NAMED[name]


def resolve_diloco(outer_optimizer: OuterOptimizer | str | None,
                   encoding: TopK | str | None
                   ) -> tuple[OuterOptimizer | None, TopK | None]:
    """The master's DiLoCo options, validated: (None, None) for plain parameter averaging;
    otherwise the outer optimizer (default: plain averaging, SGD at lr 1) and the encoding
    (default ``TopK()``: 5% of the entries in int8, as ``training_mode="diloco"``).

    ``encoding`` may be a ``TopK``, ``"topk"`` (its defaults) or ``"dense"`` (everything in
    fp32); ``outer_optimizer`` a factory or ``"averaging"`` / ``"nesterov"``.
    """
    if outer_optimizer is None and encoding is None:
        return None, None
    factory = _named(outer_optimizer) if isinstance(outer_optimizer, str) else \
        outer_optimizer or averaging_outer_optimizer
    check_outer(factory)
    if encoding is None or encoding == "topk":
        chosen = TopK()
    elif encoding == "dense":
        chosen = TopK(density=1.0, values="fp32")
    elif isinstance(encoding, TopK):
        chosen = encoding
    else:
        raise ValueError(f"encoding={encoding!r}; expected a paraloom.spark.TopK, 'topk' "
                         "(5% of the entries in int8) or 'dense'")
    return factory, chosen


class OuterStep:
    """The anchor (the trainable parameters every task starts a round from) and the outer
    optimizer over it, which lives on the driver for the whole fit."""

    def __init__(self, state: ModelState, names: Iterable[str], factory: OuterOptimizer) -> None:
        self.names = list(names)
        missing = [n for n in self.names if n not in state]
        if missing:
            raise ValueError(f"the model's state has no {missing[0]!r}; DiLoCo moves the "
                             "parameters named by model.named_parameters()")
        self.anchors = [state[n].detach().to(torch.promote_types(state[n].dtype, torch.float32))
                        .clone() for n in self.names]
        self.outer = factory(self.anchors)
        self.numel = sum(a.numel() for a in self.anchors)

    def step(self, state: ModelState, mean: np.ndarray) -> ModelState:
        """Step the anchor with the mean pseudo-gradient; ``state`` with the new anchor in."""
        if mean.size != self.numel:
            raise ValueError(f"the pseudo-gradient has {mean.size} entries; the model's "
                             f"trainable parameters {self.numel}")
        offset = 0
        for anchor in self.anchors:
            part = mean[offset:offset + anchor.numel()]
            anchor.grad = torch.from_numpy(np.ascontiguousarray(part)).reshape(anchor.shape) \
                .to(anchor.dtype)
            offset += anchor.numel()
        self.outer.step()
        out = dict(state)
        for name, anchor in zip(self.names, self.anchors, strict=True):
            anchor.grad = None
            out[name] = anchor.detach().to(state[name].dtype).clone()
        return out


def state_update(previous: np.ndarray | None, state: ModelState, full_bytes: int,
                 sequence: int) -> tuple[bytes | None, np.ndarray]:
    """The bytes that take ``flatten(previous state)`` to ``flatten(state)`` (the positions
    that changed and their new values, exactly), or None when that is not much smaller than
    the full state (or the state holds a module's extra state that is not a tensor, which
    only the full state carries); and ``flatten(state)`` for the next round's comparison."""
    flat, _ = flatten(dict(sorted(state.items())))  # the executors' order (see keep_state)
    if previous is None or previous.shape != flat.shape or previous.dtype != flat.dtype \
            or len(tensors_of(state)) != len(state):
        return None, flat
    changed = np.flatnonzero(previous != flat)
    wide = flat.size >= 2**31
    size = changed.size * ((8 if wide else 4) + flat.itemsize)
    if size >= SPARSE_UPDATE_FRACTION * full_bytes:
        return None, flat
    positions = torch.from_numpy(changed.astype(np.int64 if wide else np.int32))
    values = torch.from_numpy(flat[changed])
    data = st_save({"positions": positions, "values": values},
                   metadata={"sequence": str(sequence), "numel": str(flat.size)})
    return data, flat
