"""Resolve ``training_mode`` (a name, a ``TrainingMode`` or a ``Synchronizer``) to a synchronizer."""

from __future__ import annotations

import importlib
import inspect
from enum import Enum
from typing import Any

from paraloom.sync.base import Synchronizer

__all__ = ["TrainingMode", "create_synchronizer", "training_modes"]


class TrainingMode(str, Enum):
    """DL4J's training modes, plus dense all-reduce."""

    AVERAGING = "averaging"
    SHARED_GRADIENTS = "shared_gradients"
    ALLREDUCE = "allreduce"
    CUSTOM = "custom"


# name -> "module:Class"; imported on first use, so a mode's dependencies load only when chosen.
_FACTORIES = {
    "averaging": "paraloom.sync.averaging:Averaging",
    "shared_gradients": "paraloom.sync.sharing:SharedGradients",
    "allreduce": "paraloom.sync.allreduce:AllReduce",
}
_ALIASES = {"ddp": "allreduce", "all_reduce": "allreduce", "shared_gradient": "shared_gradients",
            "parameter_averaging": "averaging"}


def training_modes() -> tuple[str, ...]:
    """The names ``training_mode`` accepts (besides a ``Synchronizer`` instance)."""
    return (*_FACTORIES, "custom")


def _load(name: str) -> type[Synchronizer]:
    module, _, attr = _FACTORIES[name].partition(":")
    return getattr(importlib.import_module(module), attr)


def _normalize(training_mode: Any) -> str:
    if isinstance(training_mode, TrainingMode):
        return training_mode.value
    if not isinstance(training_mode, str):
        raise TypeError(f"training_mode={training_mode!r} ({type(training_mode).__name__}); "
                        f"expected one of {training_modes()}, a TrainingMode, or a Synchronizer "
                        f"instance")
    name = training_mode.strip().lower().replace("-", "_")
    return _ALIASES.get(name, name)


def create_synchronizer(training_mode: Any, **options: Any) -> Synchronizer:
    """Build the synchronizer for ``training_mode`` with the options the user set.

    Options whose value is None count as not set. A ``Synchronizer`` instance is returned as
    is (it is configured through its own constructor, so options are refused). An option the
    chosen mode does not take raises TypeError rather than being ignored, as DL4J did.
    """
    given = {key: value for key, value in options.items() if value is not None}
    if isinstance(training_mode, Synchronizer):
        if given:
            raise TypeError(f"options {sorted(given)} do not apply to a Synchronizer instance "
                            f"({type(training_mode).__name__}); pass them to its constructor")
        return training_mode
    if isinstance(training_mode, type) and issubclass(training_mode, Synchronizer):
        raise TypeError(f"training_mode={training_mode.__name__} is a class; expected an "
                        f"instance: training_mode={training_mode.__name__}(...)")
    name = _normalize(training_mode)
    if name == "custom":
        raise ValueError("training_mode='custom' needs the synchronizer itself: pass an "
                         "instance, e.g. training_mode=Fp16AllReduce() or your own subclass "
                         "of paraloom.Synchronizer")
    if name not in _FACTORIES:
        raise ValueError(f"training_mode={training_mode!r}; expected one of {training_modes()} "
                         f"(or a Synchronizer instance)")
    factory = _load(name)
    accepted = [p for p in inspect.signature(factory).parameters if p not in ("self",)]
    takes_any = any(p.kind is p.VAR_KEYWORD
                    for p in inspect.signature(factory).parameters.values())
    unknown = sorted(set(given) - set(accepted))
    if unknown and not takes_any:
        raise TypeError(f"option(s) {unknown} do not apply to training_mode={name!r}; it takes "
                        f"{[p for p in accepted if not p.startswith('_')]}")
    return factory(**given)
