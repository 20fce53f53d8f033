"""Resolve a ``training_mode`` (a name, an Enum member, a Synchronizer) to a synchronizer."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterable
from enum import Enum
from typing import Any

from paraloom._warnings import warn
from paraloom.sync.base import Synchronizer

__all__ = ["build_synchronizer", "training_modes"]

# name -> "module:Class"; imported on first use, so a mode's dependencies load only when chosen.
_FACTORIES = {
    "averaging": "paraloom.sync.averaging:Averaging",
    "shared_gradients": "paraloom.sync.sharing:SharedGradients",
    "allreduce": "paraloom.sync.allreduce:AllReduce",
    "diloco": "paraloom.sync.diloco:DiLoCo",
}
_ALIASES = {"ddp": "allreduce", "all_reduce": "allreduce", "shared_gradient": "shared_gradients",
            "parameter_averaging": "averaging"}
# ParallelWrapper's averaging options and their defaults: passed whatever the mode, they only
# mean something to "averaging"; a non-default value with another mode is a mistake.
_AVERAGING_OPTIONS = {"averaging_frequency": ("frequency", 1),
                      "average_updaters": ("average_updaters", True)}


def training_modes() -> tuple[str, ...]:
    """The names ``training_mode`` accepts (besides a ``Synchronizer`` instance)."""
    return (*_FACTORIES, "custom")


def _load(name: str) -> type[Synchronizer]:
    module, _, attr = _FACTORIES[name].partition(":")
    factory = getattr(importlib.import_module(module), attr)
    if not (isinstance(factory, type) and issubclass(factory, Synchronizer)):
        raise TypeError(f"{_FACTORIES[name]} is not a Synchronizer subclass")
    return factory


def _normalize(training_mode: object) -> str:
    value = training_mode.value if isinstance(training_mode, Enum) else training_mode
    if not isinstance(value, str):
        raise TypeError(f"training_mode={training_mode!r} ({type(training_mode).__name__}); "
                        f"expected one of {training_modes()} or a Synchronizer instance")
    name = value.strip().lower().replace("-", "_")
    return _ALIASES.get(name, name)


def _mode_options(name: str, given: dict[str, Any]) -> dict[str, Any]:
    """Map ParallelWrapper's option names onto the constructor's; refuse misplaced ones."""
    out = dict(given)
    for option, (argument, default) in _AVERAGING_OPTIONS.items():
        if option not in out:
            continue
        value = out.pop(option)
        if name == "averaging":
            out[argument] = value
        elif value != default or type(value) is not type(default):  # True == 1, 1.0 == 1
            hint = ("; its own interval is sync_every=" if name == "diloco"
                    else f"; training_mode={name!r} synchronizes every step")
            raise TypeError(f"{option}={value!r} applies to training_mode='averaging' only"
                            + hint)
    return out


def _wrapper_names(name: str, parameters: Iterable[str]) -> list[str]:
    """A mode's constructor options as ParallelWrapper names them (averaging_frequency=...)."""
    renamed = {argument: option for option, (argument, _) in _AVERAGING_OPTIONS.items()}
    return sorted(renamed.get(p, p) if name == "averaging" else p for p in parameters)


def build_synchronizer(training_mode: str | Enum | Synchronizer | type[Synchronizer],
                       **options: Any) -> Synchronizer:
    """Build the synchronizer for ``training_mode`` with the options the user set.

    Options whose value is None count as not set. A ``Synchronizer`` instance is returned as
    is (it is configured through its own constructor, so options are refused). An option the
    chosen mode does not take raises TypeError rather than being ignored, as DL4J did.
    """
    given = {key: value for key, value in options.items() if value is not None}
    if isinstance(training_mode, Synchronizer):
        given = _mode_options("custom", given)
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
    given = _mode_options(name, given)
    factory = _load(name)
    parameters = inspect.signature(factory).parameters
    named = {k for k, p in parameters.items() if p.kind is p.KEYWORD_ONLY
             or p.kind is p.POSITIONAL_OR_KEYWORD}
    passed_on: frozenset[str] = getattr(factory, "passed_on", frozenset())  # its **options
    if misplaced := {key: owners for key in sorted(set(given) - named - passed_on)
                     if (owners := _modes_taking(key))}:
        raise TypeError(f"option(s) {sorted(misplaced)} do not apply to training_mode={name!r}"
                        ": " + "; ".join(f"{key} is an option of training_mode={owners[0]!r}"
                                         for key, owners in misplaced.items())
                        + f" (training_mode={name!r} takes {_wrapper_names(name, named)}"
                        + (" and DistributedDataParallel's keywords)" if name == "allreduce"
                           else ")"))
    if not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        unknown = sorted(set(given) - set(parameters))
        if unknown:
            raise TypeError(f"option(s) {unknown} do not apply to training_mode={name!r}: they "
                            f"are neither ParallelWrapper arguments nor options of this mode, "
                            f"which takes {_wrapper_names(name, parameters)}")
    return factory(**given)


def _modes_taking(option: str) -> list[str]:
    """The built-in modes whose constructors name ``option``."""
    taking = []
    for mode in _FACTORIES:
        parameter = inspect.signature(_load(mode)).parameters.get(option)
        if parameter is not None and parameter.kind is not parameter.VAR_KEYWORD:
            taking.append(mode)
    return taking


_STEP_HOOKS = ("before_step", "after_backward", "after_step")


def warn_without_idle_step(sync: Synchronizer) -> None:
    """Warn when ``sync`` talks to its peers in a step's hooks but has no ``idle_step``: a
    replica without a batch in an epoch's short last round then makes none of the calls its
    peers wait in, and the fit hangs until ``step_timeout``. Only where there are peers: the
    caller knows (ParallelWrapper with ``workers > 1``, Spark's SharedTrainingMaster)."""
    cls = type(sync)
    if cls.idle_step is not Synchronizer.idle_step:
        return
    hooks = [h for h in _STEP_HOOKS if getattr(cls, h) is not getattr(Synchronizer, h)]
    if hooks:
        warn(
            f"{cls.__name__} overrides {', '.join(hooks)} but not idle_step: if those hooks "
            "make collective calls, a replica without a batch (the short last round of an "
            "epoch whose batches do not divide by workers) makes none of them, its peers wait, "
            "and the fit fails after step_timeout. Define idle_step(ctx) making the same calls "
            "(with zero gradients; see the custom synchronizer guide)")
