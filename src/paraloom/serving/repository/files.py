"""Which model files a remote ``load`` request may read, and how a new version is built from one.

The rule: a client never sends code, pickles or file contents. It may only name a safetensors file
written by ``paraloom.save`` that the operator allowed: the file the server was started from, or a
file inside the configured models directory. The file must hold weights for the architecture being
served (same header spec, same parameter names and shapes); the new model is a copy of the served
one with those weights loaded, so nothing named in the file is ever imported or called.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from paraloom.safetensors_files import read_consistently, read_header
from paraloom.serving.errors import ForbiddenError, ProtocolError, short_repr
from paraloom.serving.repository.binding import BoundModel

__all__ = ["ModelFiles", "check_load_parameters", "holds_weights", "same_state"]

_SUFFIX = ".safetensors"


def check_load_parameters(parameters: Mapping[str, object]) -> None:
    """Refuse Triton's upload parameters (``file:...``, ``config``): 403."""
    for key in parameters:
        if key.startswith("file:") or key == "config":
            raise ForbiddenError(f"load parameter {key!r} is refused: paraloom never takes "
                                 "model files or configs from clients; copy the file into "
                                 "the server's models directory and send {\"path\": NAME}")


class ModelFiles:
    """The files a server may load new versions from: ``model_file`` and files in ``model_dir``."""

    def __init__(self, *, model_file: str | Path | None = None,
                 model_dir: str | Path | None = None) -> None:
        self.model_file = None if model_file is None else Path(model_file).resolve()
        self.model_dir = None if model_dir is None else Path(model_dir).resolve()
        if self.model_dir is not None and not self.model_dir.is_dir():
            raise ValueError(f"model_dir {str(model_dir)!r} is not a directory; pass the folder "
                             "that holds the .safetensors files clients may load")
        self._spec = None if self.model_file is None else _architecture(read_header(
            self.model_file))

    @property
    def enabled(self) -> bool:
        """Whether any load is allowed at all."""
        return self.model_file is not None or self.model_dir is not None

    def resolve(self, parameters: Mapping[str, object]) -> Path:
        """The file a load request's parameters name, if the rule allows it."""
        if not self.enabled:
            raise ForbiddenError("model loading is disabled on this server: start it from a "
                                 "model file or with a models directory (model_dir=...)")
        check_load_parameters(parameters)
        raw = parameters.get("path")
        if raw is None:
            if self.model_file is None:
                raise ProtocolError("load needs parameters.path naming a .safetensors file in "
                                    "the models directory")
            return self.model_file
        if not isinstance(raw, str) or not raw:
            raise ProtocolError(f"parameters.path must be a file name, got {raw!r}")
        return self._inside_dir(raw)

    def _inside_dir(self, raw: str) -> Path:
        if self.model_dir is None:
            raise ForbiddenError(f"cannot load {raw!r}: this server has no models directory, "
                                 "so it only reloads the file it was started from (send no path)")
        try:
            path = (self.model_dir / raw).resolve()  # resolve() follows symlinks and '..'
            if not path.is_relative_to(self.model_dir):
                raise ForbiddenError(f"path {short_repr(raw)} is outside the models directory; "
                                     "name a file inside it, e.g. 'lenet-v2.safetensors'")
            if path.suffix != _SUFFIX:
                raise ForbiddenError(f"path {short_repr(raw)} is not a {_SUFFIX} file; only "
                                     "weights written by paraloom.save can be loaded")
            is_file = path.is_file()
        except (ValueError, OSError) as e:  # a NUL byte, a name too long for the file system
            raise ProtocolError(f"parameters.path {short_repr(raw)} is not a usable file name "
                                f"({type(e).__name__}: {e}); name a .safetensors file in the "
                                "models directory, e.g. 'lenet-v2.safetensors'") from e
        if not is_file:
            raise ProtocolError(f"no file {short_repr(raw)} in the models directory")
        return path

    def build(self, path: Path, served: nn.Module) -> nn.Module:
        """A copy of ``served`` with the weights in ``path``; ``ProtocolError`` if they differ."""
        if isinstance(served, BoundModel):  # the weights are the wrapped model's
            return BoundModel(self.build(path, served.model), served.binding)
        try:
            header, state = read_consistently(path)
        except (ValueError, OSError) as e:  # a corrupt file is a ValueError
            raise ProtocolError(f"cannot read {path.name}: {e}") from e
        spec = _architecture(header)
        if self._spec is not None and spec != self._spec:
            raise ProtocolError(f"{path.name} holds a different architecture ({spec}) than the "
                                f"served model ({self._spec}); serve it from a new server")
        expected = {k: _shape(v) for k, v in served.state_dict().items()}
        found = {k: _shape(v) for k, v in state.items()}
        if expected != found:
            diff = sorted(k for k in expected.keys() | found.keys()
                          if expected.get(k) != found.get(k))
            raise ProtocolError(f"{path.name} does not fit the served model: parameters differ "
                                f"in name or shape: {diff[:8]}")
        model = copy.deepcopy(served)
        model.load_state_dict(state, strict=True)
        return model


def _shape(value: object) -> tuple[int, ...] | None:
    """A tensor's shape; None for a module's extra state (any JSON value)."""
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _architecture(header: Mapping[str, object]) -> dict[str, object]:
    """The header's architecture: what a file's weights must share with the served model's."""
    return {k: header[k] for k in ("name", "class", "kwargs") if k in header}


def same_state(one: Mapping[str, object], other: Mapping[str, object]) -> bool:
    """Whether two state_dicts hold the same tensors (names, dtypes, values) and extra states."""
    if one.keys() != other.keys():
        return False
    for key, value in one.items():
        theirs = other[key]
        if isinstance(value, torch.Tensor) and isinstance(theirs, torch.Tensor):
            if value.dtype != theirs.dtype or not torch.equal(value, theirs.to(value.device)):
                return False
        elif isinstance(value, torch.Tensor) or isinstance(theirs, torch.Tensor) \
                or value != theirs:
            return False
    return True


def holds_weights(path: Path, model: nn.Module) -> bool:
    """Whether the file at ``path`` holds the weights ``model`` serves (False where it cannot
    be read: a build from it says why)."""
    inner = model.model if isinstance(model, BoundModel) else model
    try:
        state = read_consistently(path)[1]
    except (ValueError, OSError):
        return False
    return same_state(state, inner.state_dict())
