"""Save and load models as safetensors weights plus a small JSON header; never unpickles."""

from __future__ import annotations

import inspect
import json
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import torch
from safetensors.torch import save_file
from torch import Tensor, nn
from torch.nn.parameter import is_lazy

from paraloom._warnings import warn as warn_at_caller
from paraloom.extra_state import split_extra_state, tensors_of
from paraloom.models import MLP, LeNet
from paraloom.safetensors_files import (
    HEADER_KEY,
    atomic_write,
    check_storable,
    read_consistently,
)

if TYPE_CHECKING:
    from typing_extensions import NotRequired

__all__ = ["save", "load", "register_model"]


# The header ``save`` writes: "name" (registered) or "class" (an import path), the kwargs to
# call it with, and the caller's metadata. The functional form, as "class" is a keyword; the
# types are quoted because NotRequired is typing_extensions' before Python 3.11.
ModelSpec = TypedDict("ModelSpec", {"kwargs": "dict[str, Any]", "name": "NotRequired[str]",
                                    "class": "NotRequired[str]",
                                    "metadata": "NotRequired[dict[str, Any]]",
                                    "extra_state": "NotRequired[dict[str, Any]]"})
_REGISTRY: dict[str, type[nn.Module] | Callable[..., nn.Module]] = {"lenet": LeNet, "mlp": MLP}


def _required_arguments(cls: type[nn.Module], kwargs: dict[str, Any]) -> list[str]:
    """The constructor's arguments without a default that ``kwargs`` does not give."""
    try:
        parameters = inspect.signature(cls.__init__).parameters.values()
    except (TypeError, ValueError):  # a builtin or C-implemented constructor
        return []
    return [p.name for p in list(parameters)[1:] if p.default is p.empty
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in kwargs]


def register_model(name: str, factory: type[nn.Module] | Callable[..., nn.Module]) -> None:
    """Let ``load`` rebuild models saved under ``name`` by calling ``factory(**kwargs)``."""
    _REGISTRY[name] = factory


# Containers are built from the modules given to them, which a file cannot name.
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


def _default_kwargs(model: nn.Module, kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """``kwargs``, else the model's ``config`` when it is a dict (a config object, as a
    Hugging Face model's, is no constructor's keywords: then none)."""
    if kwargs is not None:
        return kwargs
    config = getattr(model, "config", None)
    return dict(config) if isinstance(config, Mapping) else {}


def _registered_name(model: nn.Module, name: str | None) -> str | None:
    return name if name is not None else next(
        (n for n, f in _REGISTRY.items() if f is type(model)), None)


def rebuild_problem(model: nn.Module, name: str | None = None,
                    kwargs: dict[str, Any] | None = None) -> str | None:
    """Why a file saved from ``model`` could not rebuild it without ``factory=``; None if it can."""
    if _registered_name(model, name) is not None:
        return None
    cls = type(model)
    if cls in _CONTAINERS:
        return (f"a plain {cls.__name__} is built from the layers given to it, which the file "
                f"cannot name (loading it alone gives an empty {cls.__name__})")
    needed = _required_arguments(cls, _default_kwargs(model, kwargs))
    if needed:
        return (f"{cls.__qualname__} needs {needed} to be built, and neither kwargs= nor a "
                "model.config dict gives them")
    return None


def _model_spec(model: nn.Module, name: str | None, kwargs: dict[str, Any] | None,
                warn: bool = True) -> ModelSpec:
    kwargs = _default_kwargs(model, kwargs)
    name = _registered_name(model, name)
    spec: ModelSpec = {"kwargs": kwargs}
    if name is not None:
        spec["name"] = name
    else:
        cls = type(model)
        spec["class"] = f"{cls.__module__}:{cls.__qualname__}"
        problem = rebuild_problem(model, name, kwargs)
        if problem and warn:
            warn_at_caller(f"{problem}: paraloom.load will need factory= (a function returning "
                           "the model); or save with kwargs={...} (for constructor "
                           "arguments), or register_model(name, build) and save with name=, "
                           "to make the file rebuild itself")
    try:
        json.dumps(spec)
    except TypeError as e:
        raise TypeError(f"model kwargs {kwargs!r} must be JSON-serializable to be saved: "
                        f"{e}") from e
    return spec


def save(model: nn.Module, path: str | Path, *, name: str | None = None,
         kwargs: dict[str, Any] | None = None, metadata: dict[str, Any] | None = None) -> None:
    """Write ``model``'s state_dict as safetensors, with how to rebuild it in the header.

    The model is rebuilt from a registered ``name`` (LeNet and MLP are built in; see
    ``register_model``) or its class's import path, called with ``kwargs`` (default: the
    model's ``config`` attribute if it has one). ``load`` rebuilds a class by path only from a
    module the loading program has already imported. A ``torch.compile``'d model is saved as
    the model it compiles (its weights and class), which loads without compiling.
    """
    model = getattr(model, "_orig_mod", model) if _compiled(model) else model
    _write(model, path, _model_spec(model, name, kwargs), metadata)


def _compiled(model: nn.Module) -> bool:
    """Whether ``model`` is ``torch.compile``'s wrapper (an ``OptimizedModule``)."""
    return type(model).__name__ == "OptimizedModule" and isinstance(
        getattr(model, "_orig_mod", None), nn.Module)


def _write(model: nn.Module, path: str | Path, spec: ModelSpec,
           metadata: dict[str, Any] | None) -> None:
    """Write ``model``'s weights and the header ``spec`` (plus ``metadata``) to ``path``."""
    if metadata:
        spec["metadata"] = metadata
    own, extra = split_extra_state(model.state_dict(), "paraloom.save")
    if extra:
        spec["extra_state"] = extra
    # safetensors refuses shared or non-contiguous storage: store independent copies.
    tensors = {k: v.detach().cpu().contiguous().clone() for k, v in own.items()}
    check_storable(tensors, "paraloom.save")
    header = {HEADER_KEY: json.dumps(spec)}
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=header))


def _check_device(device: str | torch.device) -> None:
    """A ValueError naming ``map_location`` when it is not a device this machine has."""
    try:
        torch.empty(0, device=device)
    except (RuntimeError, ValueError, TypeError, AssertionError) as e:
        raise ValueError(f"map_location={str(device)!r} is not a device torch can use here "
                         f"({type(e).__name__}: {str(e).splitlines()[0]}); pass 'cpu' or a "
                         "device this machine has") from e


def _check_shapes(path: Path, model: nn.Module | None, state: dict[str, Tensor]) -> None:
    """``ValueError`` where ``model``'s tensors have other shapes than the file's."""
    if model is None:
        return
    saved = tensors_of(state)
    mismatched = {k: (tuple(v.shape), tuple(saved[k].shape)) for k, v
                  in tensors_of(model.state_dict()).items() if k in saved and not is_lazy(v)
                  and v.shape != saved[k].shape}  # a lazy one takes the file's shape
    if mismatched:
        shown = dict(list(mismatched.items())[:10])
        raise ValueError(f"{path} does not match the rebuilt model: shapes (model, file) "
                         f"{shown}{' ...' if len(mismatched) > 10 else ''}; pass the factory "
                         "(and kwargs) it was saved from")


def _built_on_meta(spec: dict[str, Any]) -> nn.Module | None:
    """The file's model built on the meta device (no memory); None where its constructor
    cannot run there (it reads a tensor's values), and the real build checks it instead."""
    try:
        with torch.device("meta"):
            return _build(spec, None)
    except Exception:  # noqa: BLE001 - the real build says what is wrong, if anything is
        return None


def _check_keys(path: Path, model: nn.Module, state: dict[str, Tensor],
                factory: Callable[..., nn.Module] | None) -> None:
    """``ValueError`` where ``model`` has tensors the file lacks, or the file has others."""
    expected = model.state_dict()
    missing = _untied([k for k in expected if k not in state], model, state)
    unexpected = [k for k in state if k not in expected]
    if missing or unexpected:
        _mismatched_keys(path, missing, unexpected, factory)


def _untied(missing: list[str], model: nn.Module, state: Mapping[str, Tensor]) -> list[str]:
    """``missing`` less the names tied to a tensor that ``state`` has (``head.weight`` where
    ``head.weight = emb.weight``): a file with one name per shared tensor, as
    ``safetensors.torch.save_model`` writes it, fills both."""
    if not missing:
        return missing
    names: dict[int, list[str]] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False),
                    *model.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(t), []).append(name)
    tied = {n: group for group in names.values() if len(group) > 1 for n in group}
    return [k for k in missing if not any(other in state for other in tied.get(k, ()))]


def _mismatched_keys(path: Path, missing: list[str], unexpected: list[str],
                     factory: Callable[..., nn.Module] | None) -> None:
    hint = "" if factory is not None else (
        "; a model saved without its own class (an nn.Sequential, a function's model) "
        "loads with factory= the function that built it (--factory module:callable on "
        "the command line)")
    raise ValueError(f"{path} does not match the rebuilt model: missing {missing[:10]}, "
                     f"unexpected {unexpected[:10]}{hint}")


def _build(spec: dict[str, Any], factory: Callable[..., nn.Module] | None) -> nn.Module:
    model = _built(spec, factory)
    if not isinstance(model, nn.Module):
        what = f"factory={getattr(factory, '__name__', factory)!r}" if factory is not None \
            else f"the file's model {spec.get('name') or spec.get('class')!r}"
        raise TypeError(f"{what} returned {type(model).__name__}, not an nn.Module; pass a "
                        "function that builds and returns the model")
    return model


def _built(spec: dict[str, Any], factory: Callable[..., nn.Module] | None) -> object:
    kwargs = spec.get("kwargs", {})
    if factory is not None:
        return _call_factory(factory, kwargs)
    if "name" in spec:
        if not isinstance(spec["name"], str):
            raise ValueError(f"the file's paraloom header names the model {spec['name']!r}, "
                             "not a string: it was not written by paraloom.save; pass factory=")
        if spec["name"] not in _REGISTRY:
            raise KeyError(f"model name {spec['name']!r} is not registered (known: "
                           f"{sorted(_REGISTRY)}); call paraloom.register_model first or pass "
                           "factory=")
        build: Callable[..., nn.Module] = _REGISTRY[spec["name"]]
    elif isinstance(spec.get("class"), str):
        build = _imported_class(spec["class"])
    else:
        raise ValueError("the file's paraloom header names no model (neither 'name' nor "
                         "'class'): pass factory= (the function that builds the model)")
    try:
        return build(**kwargs)
    except (TypeError, ValueError, RuntimeError) as e:  # e.g. a size < 0 in crafted kwargs
        kind = TypeError if isinstance(e, TypeError) else ValueError
        raise kind(f"rebuilding the model as {spec.get('name') or spec['class']}"
                   f"(**{kwargs!r}) failed ({type(e).__name__}: {e}); pass factory= (a "
                   "function returning the model), or save it with the kwargs= its "
                   "constructor takes") from e


def _call_factory(factory: Callable[..., nn.Module], kwargs: dict[str, Any]) -> nn.Module:
    """``factory(**kwargs)`` (the constructor arguments the file was saved with), or
    ``factory()`` for a factory that takes none of them; a TypeError naming both otherwise."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin without a signature: call it as saved
        return factory(**kwargs)
    for given in (kwargs, {}):
        try:
            signature.bind(**given)
        except TypeError:
            continue
        return factory(**given)
    raise TypeError(f"factory={getattr(factory, '__name__', factory)!r} takes neither the "
                    f"constructor arguments the file was saved with ({sorted(kwargs)}) nor "
                    "none; pass a factory that takes those keywords, or none")


def _imported_class(path: str) -> type[nn.Module]:
    """The nn.Module class at ``module:qualname``, from a module this program already imported.

    A file never makes paraloom import a module or call anything but a model class: otherwise a
    crafted header could run any function (``subprocess:run``) on load.
    """
    module_name, _, qualname = path.partition(":")
    module = sys.modules.get(module_name)
    if module is None:
        raise ValueError(f"the file's model class {path!r} is in module {module_name!r}, which "
                         "this program has not imported: import it first, register the class "
                         "with paraloom.register_model(name, cls), or pass factory= (on the "
                         "command line: --factory module:callable; paraloom serve also takes "
                         "--import MODULE)")
    obj: object = module
    for part in qualname.split("."):
        # Static lookups: a module's __getattr__ (torch's) would import what the file names.
        obj = inspect.getattr_static(obj, part, None) if obj is not None else None
    if obj is None:
        raise ValueError(f"the file's model class {qualname!r} is not in module "
                         f"{module_name!r} of this program (a class defined in the script that "
                         "saved it is not in another script's __main__): define or import it, "
                         "register it with paraloom.register_model(name, cls), or pass "
                         "factory= (--factory module:callable on the command line)")
    if not (isinstance(obj, type) and issubclass(obj, nn.Module)):
        raise ValueError(f"the file names {path!r} as its model class, which is not an "
                         "nn.Module subclass: refusing to call it")
    return obj


def load(path: str | Path, *, factory: Callable[..., nn.Module] | None = None,
         map_location: str | torch.device = "cpu") -> nn.Module:
    """Rebuild a model written by ``save`` and load its weights (safetensors: no pickle).

    ``factory`` (a function returning the model, called with the constructor arguments the file
    was saved with when it takes them) builds the model instead of the file's own record; with
    it, a plain safetensors file of weights (no paraloom header) loads too, every tensor
    matched by name and cast to the built model's dtype (as ``load_state_dict`` does; a
    file ``save`` wrote keeps its saved dtypes). ``map_location`` is where the weights go
    ("cpu", "cuda:1", "meta").

    Raises FileNotFoundError for a missing file, ValueError for a folder, a corrupt file, a
    training checkpoint, or weights that do not match the model (naming the keys or shapes),
    KeyError for an unregistered model name, TypeError for a factory returning no module."""
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model file {str(path)!r} does not exist")
    if path.is_dir():
        raise ValueError(f"{path} is a folder; give the model's file (a .safetensors written "
                         "by paraloom.save)")
    _check_device(map_location)
    device = torch.device(map_location)
    # safetensors reads to "cpu" or an accelerator by name, not "cpu:0" or "meta"
    spec, state = read_consistently(path, "cpu" if device.type in ("cpu", "meta") else device,
                                    plain=factory is not None)
    if spec.get("kwargs") and factory is None:
        # The file's constructor arguments could ask for any size (num_classes=10**8): the
        # file's model is built on the meta device first, which allocates nothing, and checked
        # (a factory is the caller's own code, and is called once).
        probe = _built_on_meta(spec)
        _check_shapes(path, probe, state)
        if probe is not None:
            _check_keys(path, probe, state, factory)
    model = _build(spec, factory)
    _check_shapes(path, model, state)
    # The saved dtypes before the values: load_state_dict copies into the rebuilt model's
    # tensors, so a float64 file read into float32 ones would lose its values (rounded, 1e300
    # to inf), a complex buffer its imaginary part, before any cast back.
    model.to(map_location)
    plain = not spec  # plain weights say nothing of the model's dtype: the factory's stays
    if not plain:
        _take_dtypes(model, state)
    # On the meta device (shapes only) there is nothing to copy into: torch warned of each copy.
    if torch.device(map_location).type == "meta":
        _check_keys(path, model, state, factory)
        return model
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = _untied(missing, model, state)
    if missing or unexpected:
        _mismatched_keys(path, missing, unexpected, factory)
    if not plain:
        _take_dtypes(model, state)  # a lazy module's tensors, materialized by the load
    return model


def _take_dtypes(model: nn.Module, state: dict[str, Tensor]) -> None:
    """Give each parameter and buffer its saved tensor's dtype (ties kept: in place). A
    floating buffer the file does not hold (``persistent=False``: a rotary table, a mask)
    takes the saved floating tensors' dtype where they all have one, as ``model.half()``
    gave it on the model that was saved."""
    floats = {t.dtype for t in state.values() if isinstance(t, Tensor) and t.is_floating_point()}
    common = next(iter(floats)) if len(floats) == 1 else None
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            saved = state.get(name)
            dtype = saved.dtype if isinstance(saved, Tensor) else \
                common if t.is_floating_point() else None
            if dtype is not None and dtype != t.dtype and not is_lazy(t):
                t.data = t.data.to(dtype)
