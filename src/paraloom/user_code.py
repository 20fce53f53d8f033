"""The user's own model and data on the command line: ``--factory`` / ``--data pkg.module:fn``."""

from __future__ import annotations

import functools
import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

__all__ = ["build_user_model", "guarded_callable", "import_callable", "import_module", "user_data"]


def import_module(module_name: str, option: str, spec: str | None = None) -> object:
    """Import ``module_name`` (the current folder is importable, as with ``python -m``);
    ValueError naming the option (and ``spec``, what it was given) when it cannot."""
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{option} {spec or module_name!r}: cannot import {module_name!r} "
                         f"({e}); run from the folder that holds it, or add its folder to "
                         "PYTHONPATH") from e
    except Exception as e:  # the module itself fails as it runs (a NameError, a SyntaxError)
        raise ValueError(f"{option} {spec or module_name!r}: importing {module_name!r} "
                         f"failed: {type(e).__name__}: {e}") from e


def import_callable(spec: str, option: str) -> Callable[..., Any]:
    """The function at ``package.module:function`` (the current folder is importable, as with
    ``python -m``); ValueError/TypeError name the option and the expected form."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{option} {spec!r} must look like 'package.module:function'")
    obj = import_module(module_name, option, spec)
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"{option} {spec!r}: {module_name!r} has no {attr!r}") from None
    if not callable(obj):
        raise TypeError(f"{option} {spec!r} is a {type(obj).__name__}, not a callable")
    return obj


def guarded_callable(spec: str, option: str) -> Callable[..., Any]:
    """``import_callable``'s function, wrapped so that what it raises is a ValueError naming
    the option (its own ValueError or TypeError as it is): the command line then answers with
    one line, not a traceback. The wrapper keeps the function's signature."""
    fn = import_callable(spec, option)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (ValueError, TypeError):
            raise
        except Exception as e:  # the user's code: an ImportError, an AttributeError
            raise ValueError(f"{option} {spec!r} raised {type(e).__name__}: {e}") from e

    return call


def build_user_model(spec: str) -> nn.Module:
    """Call ``--factory``; it must return an ``nn.Module``."""
    model = guarded_callable(spec, "--factory")()
    if not isinstance(model, nn.Module):
        raise TypeError(f"--factory {spec!r} returned a {type(model).__name__}; expected a "
                        "torch.nn.Module")
    return model


def user_data(spec: str, option: str, batch_size: int, shuffle: bool) -> DataLoader[Any]:
    """Call ``--data``; a Dataset is batched (``batch_size``, ``shuffle``), a DataLoader is used
    as it is."""
    data = guarded_callable(spec, option)()
    if isinstance(data, DataLoader):
        return data
    if isinstance(data, IterableDataset):
        return DataLoader(data, batch_size=batch_size)
    if isinstance(data, Dataset) or (hasattr(data, "__getitem__") and hasattr(data, "__len__")):
        return DataLoader(data, batch_size=batch_size, shuffle=shuffle)
    raise TypeError(f"{option} {spec!r} returned a {type(data).__name__}; expected a "
                    "torch Dataset or DataLoader")
