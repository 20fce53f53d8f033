"""Pickling modules that carry ``torch.nn.utils.parametrize`` parametrizations.

``parametrizations.weight_norm``, ``spectral_norm`` and ``orthogonal`` swap a module's class for
a subclass made on the spot, and that class refuses to be pickled ("only supported through
state_dict()"), so such a model could not travel to a worker process or a Spark executor. The
reducer here sends the module as an instance of its own class with its ``parametrizations``
(the original tensors and the parametrization modules, pickled as usual) and rebuilds the
subclass and its properties on arrival: the same structure, tensors and parametrizations that
``copy.deepcopy`` gives.
"""

from __future__ import annotations

import copy
import io
import pickle
from typing import Any

import cloudpickle
from torch import nn
from torch.nn.utils import parametrize

from paraloom.errors import NotPicklableError

__all__ = ["ModulePickler", "by_value", "private_copy", "reduce_parametrized"]


def reduce_parametrized(obj: object) -> tuple[Any, ...] | None:
    """A pickle reduction for a parametrized module, or ``None`` for anything else.

    For a pickler's ``reducer_override``: the module's own class (the base of the class
    ``parametrize`` made), its ``__dict__`` as state, and a state setter that puts the
    parametrized class and one property per parametrized tensor back.
    """
    if not isinstance(obj, nn.Module) or not parametrize.is_parametrized(obj):
        return None
    base = type(obj).__bases__[0]
    parametrizations = obj.parametrizations
    assert isinstance(parametrizations, nn.ModuleDict)  # is_parametrized checked it
    names = tuple(parametrizations.keys())
    return (_new_module, (base,), (dict(obj.__dict__), names), None, None, _set_state)


def _new_module(cls: type[nn.Module]) -> nn.Module:
    module: nn.Module = cls.__new__(cls)
    return module


def _set_state(module: nn.Module, state: tuple[dict[str, Any], tuple[str, ...]]) -> None:
    attributes, names = state
    module.__dict__.update(attributes)
    # Private to torch but unchanged since parametrize appeared (1.9); the test that pickles
    # weight_norm, spectral_norm and orthogonal modules fails first if that ever changes.
    parametrize._inject_new_class(module)
    for name in names:
        parametrize._inject_property(module, name)


# cloudpickle has no type information, so its pickler class is Any to mypy.
class ModulePickler(cloudpickle.CloudPickler):  # type: ignore[misc]
    """cloudpickle's pickler (classes and functions from scripts by value), which also
    pickles parametrized modules (``reduce_parametrized``)."""

    def reducer_override(self, obj: object) -> Any:
        reduced = reduce_parametrized(obj)
        return super().reducer_override(obj) if reduced is None else reduced


def by_value(obj: object) -> bytes:
    """``cloudpickle.dumps(obj)``, parametrized modules included; load with ``pickle.loads``."""
    buffer = io.BytesIO()
    ModulePickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def private_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` (``NotPicklableError`` if it holds what cannot be copied);
    through pickle where ``copy.deepcopy`` refuses a tensor that
    is not a graph leaf (the hook-based ``torch.nn.utils.weight_norm`` keeps its weight so),
    as a model sent to worker processes travels anyway."""
    try:
        return copy.deepcopy(model)
    except TypeError as e:  # copy and pickle refuse locks, open files, generators, ...
        raise NotPicklableError(
            f"cannot copy the model for a replica: {e}. Every replica trains its own copy, "
            "with workers=1 too (the model you pass keeps its start weights until fit() "
            "returns): keep open files, locks, threads and generators out of the model, or "
            "create them lazily and leave them out in __getstate__") from e
    except RuntimeError as e:
        if "deepcopy" not in str(e):
            raise
        copied: nn.Module = pickle.loads(by_value(model))
        return copied
