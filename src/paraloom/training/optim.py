"""Re-create the user's optimizer on each replica's own parameters."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["OptimizerSpec", "OptimizerFactory", "load_state_copying"]

OptimizerFactory = Callable[[Iterator[nn.Parameter]], torch.optim.Optimizer]
"""``factory(model.parameters()) -> optimizer``, e.g. ``lambda p: torch.optim.SGD(p, lr=0.1)``."""


class OptimizerSpec:
    """How to build one replica's optimizer: a class with its param groups, or a factory."""

    def __init__(self, factory: OptimizerFactory | None = None, *,
                 cls: type[torch.optim.Optimizer] | None = None,
                 groups: list[dict[str, Any]] | None = None,
                 state: dict[str, Any] | None = None) -> None:
        self.factory = factory
        self.cls = cls
        self.groups = groups or []
        self.state = state

    @classmethod
    def from_user(cls, optimizer: torch.optim.Optimizer | OptimizerFactory,
                  model: nn.Module) -> OptimizerSpec:
        """Accept an optimizer built on ``model``'s parameters, or ``lambda params: ...``."""
        if isinstance(optimizer, torch.optim.Optimizer):
            return cls._from_instance(optimizer, model)
        if callable(optimizer):
            return cls(factory=optimizer)
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or a callable "
                        f"params -> Optimizer; got {type(optimizer).__name__}")

    @classmethod
    def _from_instance(cls, optimizer: torch.optim.Optimizer, model: nn.Module) -> OptimizerSpec:
        index = {id(p): i for i, p in enumerate(model.parameters())}
        groups = []
        for g in optimizer.param_groups:
            missing = [p for p in g["params"] if id(p) not in index]
            if missing:
                raise ValueError(f"the optimizer holds {len(missing)} tensor(s) that are not "
                                 "parameters of the model; build it from model.parameters()")
            hyper = {k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
            groups.append({"params": [index[id(p)] for p in g["params"]], **hyper})
        state = copy.deepcopy(optimizer.state_dict()) if optimizer.state else None
        return cls(cls=type(optimizer), groups=groups, state=state)

    def build(self, model: nn.Module) -> torch.optim.Optimizer:
        """A new optimizer over ``model``'s parameters, with the user's settings and state."""
        if self.factory is not None:
            opt = self.factory(model.parameters())
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(f"the optimizer factory returned {type(opt).__name__}; it must "
                                "return a torch.optim.Optimizer")
            return opt
        assert self.cls is not None
        params = list(model.parameters())
        groups = [{**g, "params": [params[i] for i in g["params"]]} for g in self.groups]
        # Every torch optimizer takes its param groups first; only the base class needs more.
        opt = self.cls(groups)  # type: ignore[call-arg]
        if self.state is not None:
            opt.load_state_dict(self.state)
        return opt


def load_state_copying(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    """``optimizer.load_state_dict(state_dict)``, keeping none of ``state_dict``'s tensors: each
    is copied into the optimizer's own tensor for that slot where shape and dtype match (as
    its step() updates them in place), or else cloned. (load_state_dict alone keeps them.)"""
    own = {(id(p), key): value for p, slot in optimizer.state.items()
           for key, value in slot.items() if isinstance(value, torch.Tensor)}
    optimizer.load_state_dict(state_dict)
    with torch.no_grad():
        for p, slot in optimizer.state.items():
            for key, value in slot.items():
                if not isinstance(value, torch.Tensor):
                    continue
                mine = own.get((id(p), key))
                if mine is not None and mine is not value and mine.shape == value.shape \
                        and mine.dtype == value.dtype and mine.device == value.device:
                    slot[key] = mine.copy_(value)
                else:
                    slot[key] = value.clone()
