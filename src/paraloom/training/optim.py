"""Re-create the user's optimizer on each replica's own parameters."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["OptimizerSpec", "OptimizerFactory", "load_state_copying", "trained_state"]

OptimizerFactory = Callable[[Iterator[nn.Parameter]], torch.optim.Optimizer]
"""``factory(model.parameters()) -> optimizer``, e.g. ``lambda p: torch.optim.SGD(p, lr=0.1)``."""


class OptimizerSpec:
    """How to build one replica's optimizer: a class with its param groups, or a factory."""

    def __init__(self, factory: OptimizerFactory | None = None, *,
                 cls: type[torch.optim.Optimizer] | None = None,
                 groups: list[dict[str, Any]] | None = None,
                 state: dict[str, Any] | None = None,
                 kwargs: dict[str, Any] | None = None) -> None:
        self.factory = factory
        self.cls = cls
        self.groups = groups or []
        self.state = state
        self.kwargs = kwargs or {}
        """Constructor keywords taken from the optimizer's ``defaults`` (e.g. a required lr)."""

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
                                 "parameters of the model (a layer replaced since the "
                                 "optimizer was built, or a loss of trainable parameters, a "
                                 "learned temperature?); build it from model.parameters(), "
                                 "and after replacing a layer build a new optimizer and a new "
                                 "ParallelWrapper with it; a loss's parameters train as the "
                                 "model's: hold the loss in the model (model.criterion = "
                                 "loss) and compute it in step_fn")
            hyper = {k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
            groups.append({"params": [index[id(p)] for p in g["params"]], **hyper})
        state = copy.deepcopy(optimizer.state_dict()) if optimizer.state else None
        _refuse_closure_optimizer(type(optimizer))
        kwargs = _constructor_kwargs(type(optimizer), optimizer.defaults)
        return cls(cls=type(optimizer), groups=groups, state=state, kwargs=kwargs)

    def build(self, model: nn.Module) -> torch.optim.Optimizer:
        """A new optimizer over ``model``'s parameters, with the user's settings and state."""
        if self.factory is not None:
            opt = self.factory(model.parameters())
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(f"the optimizer factory returned {type(opt).__name__}; it must "
                                "return a torch.optim.Optimizer")
            _refuse_closure_optimizer(type(opt))
            own = {id(p) for p in model.parameters()}
            if any(id(p) not in own for g in opt.param_groups for p in g["params"]):
                raise ValueError("the optimizer factory built its optimizer on tensors that "
                                 "are not the parameters it was given (each replica's own "
                                 "copy): use them, lambda params: torch.optim.SGD(params, "
                                 "lr=...), not model.parameters() of the model you wrap")
            return opt
        assert self.cls is not None
        params = list(model.parameters())
        groups = [{**g, "params": [params[i] for i in g["params"]]} for g in self.groups]
        # Every torch optimizer takes its param groups first; only the base class needs more.
        try:
            opt = self.cls(groups, **copy.deepcopy(self.kwargs))
        except TypeError as e:
            raise TypeError(f"could not rebuild {_name(self.cls)} on a replica as "
                            f"{_name(self.cls)}(param_groups, **{sorted(self.kwargs)} from its "
                            f"defaults): {e}. Pass a factory instead: "
                            f"{_factory_hint(self.cls)}") from e
        if self.state is not None:
            opt.load_state_dict(self.state)
        return opt

    def stand_in(self, model: nn.Module) -> torch.optim.Optimizer:
        """An optimizer built as ``build`` builds a replica's, but over one-element tensors in
        place of ``model``'s parameters (and without the state): a probe for what is built on
        it (an ``lr_scheduler``), costing nothing for a large model."""
        probes = [nn.Parameter(torch.zeros(1)) for _ in model.parameters()]
        if self.factory is not None:
            opt = self.factory(iter(probes))
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(f"the optimizer factory returned {type(opt).__name__}")
        else:
            assert self.cls is not None
            groups = [{**g, "params": [probes[i] for i in g["params"]]} for g in self.groups]
            opt = self.cls(groups, **copy.deepcopy(self.kwargs))
        for group in opt.param_groups:  # a tensor lr is the factory's or the spec's own object:
            for key, value in group.items():  # what is built on the stand-in must not move it
                if key != "params" and isinstance(value, torch.Tensor):
                    group[key] = value.clone()
        return opt


def _name(cls: type) -> str:
    return cls.__qualname__


def _factory_hint(cls: type) -> str:
    return f"optimizer=lambda params: {_name(cls)}(params, lr=...)"


def _constructor_kwargs(cls: type[torch.optim.Optimizer],
                        defaults: dict[str, Any]) -> dict[str, Any]:
    """The ``defaults`` entries that ``cls``'s constructor takes by name, so an optimizer whose
    constructor requires e.g. ``lr`` can be rebuilt; refuses one whose required arguments are
    not all in its defaults."""
    try:
        params = list(inspect.signature(cls).parameters.values())[1:]  # after the param groups
    except (TypeError, ValueError):  # no signature to read: param groups alone, as before
        return {}
    named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    missing = [p.name for p in named if p.default is p.empty and p.name not in defaults]
    if missing:
        raise ValueError(f"cannot rebuild the optimizer {_name(cls)} in the workers: its "
                         f"constructor requires {missing}, which are not in its defaults "
                         f"({sorted(defaults)}). Pass a factory instead: {_factory_hint(cls)}")
    return {p.name: copy.deepcopy(defaults[p.name]) for p in named if p.name in defaults}


def _refuse_closure_optimizer(cls: type[torch.optim.Optimizer]) -> None:
    """Refuse an optimizer whose ``step`` needs a closure (LBFGS): the loop calls ``step()``."""
    try:
        closure = inspect.signature(cls.step).parameters.get("closure")
    except (TypeError, ValueError):
        return
    if closure is not None and closure.default is closure.empty:
        raise ValueError(f"the optimizer {_name(cls)} needs a closure, step(closure), that "
                         "re-evaluates the loss (as LBFGS does); paraloom's loop computes one "
                         "loss per batch and calls optimizer.step() with no closure. Use an "
                         "optimizer whose step() needs none (e.g. torch.optim.Adam or SGD)")


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


def trained_state(optimizer: torch.optim.Optimizer, trained: dict[str, Any]) -> dict[str, Any]:
    """The state_dict to load into the user's ``optimizer`` after a fit: the replica's
    ``trained`` state, with what only ``optimizer`` has kept. The replicas' optimizers run
    none of its state_dict hooks, so the top-level keys a post hook adds (which a load pre
    hook may want back) are its own; param groups a listener added during the fit (which
    stopped there, untrained) follow the trained ones."""
    own = optimizer.state_dict()
    state = {**{k: v for k, v in own.items() if k not in trained}, **trained}
    groups = trained["param_groups"]
    if len(own["param_groups"]) > len(groups):
        state["param_groups"] = groups + own["param_groups"][len(groups):]
    return state
