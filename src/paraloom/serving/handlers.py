"""Handlers: code from a model's folder that runs on the server around the model.

A model folder of a models directory may hold ``handler.py`` beside ``model.safetensors`` (for
numbered versions: in the version's folder, or in the model's folder for every version)::

    INPUTS = [{"name": "text", "datatype": "BYTES", "shape": [-1]}]
    OUTPUTS = [{"name": "label", "datatype": "BYTES", "shape": [-1]},
               {"name": "score", "datatype": "FP32", "shape": [-1]}]

    def preprocess(inputs: dict[str, numpy.ndarray]) -> torch.Tensor: ...
    def postprocess(outputs: torch.Tensor) -> dict[str, numpy.ndarray]: ...

``INPUTS`` and ``OUTPUTS`` are what clients send and receive (the model's metadata lists them);
BYTES tensors reach ``preprocess`` as numpy object arrays of ``bytes`` and may be returned by
``postprocess`` as arrays of ``str`` or ``bytes``. ``preprocess`` returns the model's input: a
tensor, a tuple of tensors, or a dict of them keyed by the model's input names; without it,
the inputs go to the model as tensors, in ``INPUTS`` order. ``postprocess`` takes what the model
returned and returns every output of ``OUTPUTS``; without it, the model's outputs are sent as
they are. Both see one request's rows, on a worker thread: requests are batched for the model
between them, and each request gets its own rows back. An exception in ``preprocess`` answers
that request 400 with its message (the handler refused the input); one in ``postprocess``, or a
wrong return type, answers it 500; the server goes on.

The server imports ``handler.py`` only when told to (``paraloom serve --allow-handlers``,
``create_repository_app(allow_handlers=True)``): it is code from the repository.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from paraloom.serving.datatypes import Value, datatype_of
from paraloom.serving.errors import ProtocolError, ServingError, short_repr
from paraloom.serving.signature import ModelSignature, TensorSpec, spec_from_json
from paraloom.serving.strings import is_strings

__all__ = ["HANDLER_FILE", "Handler", "HandlerFailedError", "load_handler"]

HANDLER_FILE = "handler.py"


class HandlerFailedError(ServingError):
    """A handler's postprocess raised or returned the wrong thing (HTTP 500, gRPC INTERNAL)."""

    status = 500
    reason = "handler_error"


def _specs(raw: object, key: str, path: Path) -> tuple[TensorSpec, ...]:
    usage = (f'{path.name} must define {key} = [{{"name": ..., "datatype": "BYTES" or "FP32" '
             '..., "shape": [-1, ...]}, ...]')
    if not isinstance(raw, list | tuple) or not raw:
        raise ValueError(f"{usage}; got {short_repr(raw)}")
    specs = []
    for item in raw:
        spec = spec_from_json(item)
        if spec is None:
            raise ValueError(f"{usage}; got {short_repr(item)}")
        specs.append(spec)
    return tuple(specs)


def _function(module: object, name: str, path: Path) -> Callable[..., Any] | None:
    found = getattr(module, name, None)
    if found is not None and not callable(found):
        raise ValueError(f"{path.name}: {name} must be a function, got {type(found).__name__}")
    return found


def load_handler(path: Path, model: ModelSignature, label: str) -> Handler:
    """Import ``path`` and check what it defines; ``ValueError`` naming the problem."""
    module_name = f"paraloom_handler_{abs(hash((str(path), label)))}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look modules up by name
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(module_name, None)
        raise ValueError(f"{path.name} failed to import: {type(e).__name__}: {e}") from e
    preprocess = _function(module, "preprocess", path)
    postprocess = _function(module, "postprocess", path)
    if preprocess is None and postprocess is None:
        raise ValueError(f"{path.name} defines neither preprocess nor postprocess")
    signature = ModelSignature(_specs(getattr(module, "INPUTS", None), "INPUTS", path),
                               _specs(getattr(module, "OUTPUTS", None), "OUTPUTS", path))
    _check_direct(path, preprocess is None, signature.inputs, model.inputs, "INPUTS",
                  "preprocess")
    _check_direct(path, postprocess is None, signature.outputs, model.outputs, "OUTPUTS",
                  "postprocess")
    return Handler(path, preprocess, postprocess, signature, model)


def _check_direct(path: Path, direct: bool, declared: Sequence[TensorSpec],
                  model: Sequence[TensorSpec], key: str, function: str) -> None:
    """Without ``function``, the model's own tensors pass: ``key`` must list them as they are
    (names, datatypes and shapes)."""
    if direct and list(declared) != list(model):
        raise ValueError(f"{path.name} has no {function}, so its {key} must be the model's "
                         f"{[s.as_json() for s in model]}; got "
                         f"{[s.as_json() for s in declared]}")


def _as_numpy(value: Value) -> np.ndarray:
    return value if isinstance(value, np.ndarray) else value.numpy()


@dataclass(frozen=True)
class Handler:
    """A loaded ``handler.py``: what clients see (``signature``) and the model behind it."""

    path: Path
    preprocess: Callable[..., Any] | None
    postprocess: Callable[..., Any] | None
    signature: ModelSignature
    model: ModelSignature

    def to_model(self, values: Sequence[Value]) -> list[torch.Tensor]:
        """The model's input tensors for one request's checked inputs (``signature`` order)."""
        inputs = {s.name: _as_numpy(v) for s, v in zip(self.signature.inputs, values,
                                                        strict=True)}
        if self.preprocess is None:
            return [torch.from_numpy(np.ascontiguousarray(a)) for a in inputs.values()]
        try:
            out = self.preprocess(inputs)
        except BaseException as e:  # on a worker thread: even SystemExit is this request's
            raise ProtocolError(f"the model's handler refused the input: "
                                f"{type(e).__name__}: {e}") from e
        return self._tensors(out)

    def _tensors(self, out: object) -> list[torch.Tensor]:
        names = [s.name for s in self.model.inputs]
        if isinstance(out, Mapping):
            missing = [n for n in names if n not in out]
            if missing:
                raise HandlerFailedError(f"{self.path.name} preprocess returned keys "
                                         f"{sorted(map(str, out))}; the model's inputs are "
                                         f"{names} (missing: {missing})")
            out = tuple(out[n] for n in names)
        tensors = [out] if isinstance(out, torch.Tensor) else out
        if not isinstance(tensors, list | tuple) or not all(isinstance(t, torch.Tensor)
                                                            for t in tensors):
            raise HandlerFailedError(f"{self.path.name} preprocess returned "
                                     f"{type(out).__name__}; expected a torch.Tensor, a tuple "
                                     "of tensors, or a dict of them keyed by the model's inputs "
                                     f"{names}")
        return list(tensors)

    def from_model(self, result: Any) -> dict[str, Value]:
        """The outputs for one request, from what the model returned for its rows."""
        if self.postprocess is None:
            return dict(self.model.name_outputs(result))
        try:
            out = self.postprocess(result)
        except BaseException as e:  # on a worker thread: even SystemExit is this request's
            raise HandlerFailedError(f"{self.path.name} postprocess failed: "
                                     f"{type(e).__name__}: {e}") from e
        if not isinstance(out, Mapping):
            raise HandlerFailedError(f"{self.path.name} postprocess returned "
                                     f"{type(out).__name__}; expected a dict of output name to "
                                     "numpy array")
        missing = [s.name for s in self.signature.outputs if s.name not in out]
        if missing:
            raise HandlerFailedError(f"{self.path.name} postprocess returned "
                                     f"{sorted(map(str, out))}, without outputs {missing} that "
                                     "OUTPUTS declares")
        return {s.name: self._value(s, out[s.name]) for s in self.signature.outputs}

    def _value(self, spec: TensorSpec, value: object) -> Value:
        try:
            return self._converted(spec, value)
        except HandlerFailedError:
            raise
        except Exception as e:  # noqa: BLE001 - torch refused it: the handler's fault
            raise HandlerFailedError(f"{self.path.name} postprocess returned, for output "
                                     f"{spec.name!r}, {type(value).__name__} that cannot be "
                                     f"sent ({type(e).__name__}: {e}); return a numpy array of "
                                     f"the declared datatype {spec.datatype}") from e

    def _converted(self, spec: TensorSpec, value: object) -> Value:
        given = value  # what the error names (it is converted below)
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu()
            datatype_of(value.dtype)  # complex, quantized: no datatype to send them as
        elif isinstance(value, np.ndarray):
            if not is_strings(value):  # a big-endian or datetime array: torch refuses it
                value = torch.from_numpy(np.ascontiguousarray(value))
                datatype_of(value.dtype)
            elif value.dtype.kind == "O" and spec.datatype == "BYTES":
                odd = [v for v in value.flat if not isinstance(v, str | bytes)][:1]
                if odd:  # it would be sent as each item's str()
                    raise HandlerFailedError(
                        f"{self.path.name} postprocess returned an object array holding "
                        f"{type(odd[0]).__name__} {short_repr(odd[0])} for output "
                        f"{spec.name!r}; a BYTES output holds str or bytes only")
        else:
            raise HandlerFailedError(f"{self.path.name} postprocess returned "
                                     f"{type(value).__name__} for output {spec.name!r}; "
                                     "expected a numpy array")
        strings = not isinstance(value, torch.Tensor)
        if strings != (spec.datatype == "BYTES"):
            if strings:
                returned = "strings"
            elif isinstance(given, np.ndarray):
                returned = f"numpy {given.dtype}"
            else:
                returned = str(value.dtype)
            raise HandlerFailedError(f"{self.path.name} postprocess returned {returned} for "
                                     f"output {spec.name!r}, which OUTPUTS declares "
                                     f"{spec.datatype}")
        return value
