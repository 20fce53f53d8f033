"""Safetensors files on disk: written whole or not at all, checked before they are read, and
read as one version of the file even while another program replaces it."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from paraloom.extra_state import join_extra_state

__all__ = ["HEADER_KEY", "TRAINING_HEADER_KEY", "atomic_write", "check_safetensors",
           "check_storable", "read_consistently", "read_header", "read_tensors"]

HEADER_KEY = "paraloom"
"""The metadata key of the JSON header that ``paraloom.save`` writes."""


def atomic_write(path: str | Path, write: Callable[[str], None]) -> Path:
    """Call ``write(tmp_path)`` then rename onto ``path`` (``~`` expanded, as returned): a
    crash never leaves half a file."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise IsADirectoryError(f"{str(path)!r} is a folder; give a file name inside it, e.g. "
                                f"{str(path / 'model.safetensors')!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp's 0600 would hide the file from others
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _read_umask() -> int:
    """The process's umask (read by setting it: there is no getter), once, at import."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _read_umask()


def check_storable(tensors: dict[str, torch.Tensor], what: str) -> None:
    """Raise ``TypeError`` naming the first of ``tensors`` whose dtype safetensors cannot
    store (complex128, complex32, quantized), before ``what`` (the caller) writes anything."""
    for name, t in tensors.items():
        if t.dtype in (torch.complex128, torch.complex32) or t.is_quantized:
            raise TypeError(f"{what}: {name!r} is {str(t.dtype).removeprefix('torch.')}, which "
                            "safetensors cannot store (it stores complex64, floating-point, "
                            "integer and bool tensors); keep it as complex64, or as a real "
                            "tensor (torch.view_as_real) that the model views as complex")


def check_safetensors(path: str | Path) -> None:
    """Raise ValueError, saying what the file is and how to convert it, unless ``path`` starts
    as a safetensors file does (an 8-byte header length, then a JSON header that fits)."""
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(9)
    size = path.stat().st_size
    if len(head) == 9 and head[8:9] == b"{":
        length = int.from_bytes(head[:8], "little")
        if 0 < length <= size - 8:
            return
        raise _corrupt(path, ValueError(f"its header says {length:,} bytes of JSON, and the "
                                        f"file holds {size - 8:,} after the length"))
    if not (head.startswith(b"PK\x03\x04") or head[:1] == b"\x80"):
        raise ValueError(f"{path} is not a safetensors file (nor a PyTorch checkpoint); "
                         "paraloom reads models written by paraloom.save (.safetensors)")
    raise ValueError(
        f"{path} is a PyTorch pickle (torch.save's format: a .pt/.pth/.bin checkpoint); paraloom "
        "reads only safetensors files (loading them runs no code). Convert it once, where you "
        "trust the file: model = YourModel(); model.load_state_dict("
        f"torch.load({str(path)!r}, weights_only=True)); paraloom.save(model, "
        "'model.safetensors')")


TRAINING_HEADER_KEY = "paraloom_checkpoint"
"""The metadata key of a ``TrainingCheckpoint``'s JSON header (``save`` writes another)."""


def read_header(path: str | Path, *, plain: bool = False) -> dict[str, Any]:
    """The JSON header written by ``save``; with ``plain``, ``{}`` for a safetensors file that
    has none (plain weights, e.g. ``safetensors.torch.save_file``'s)."""
    check_safetensors(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as e:  # safetensors' own error type: a corrupt or truncated file
        raise _corrupt(path, e) from e
    if HEADER_KEY not in meta:
        if plain and TRAINING_HEADER_KEY not in meta:
            return {}
        if TRAINING_HEADER_KEY in meta:
            raise ValueError(
                f"{path} is a paraloom training checkpoint, not a saved model: resume with "
                "fit(..., resume_from=path), or take its weights with model.load_state_dict("
                "paraloom.TrainingCheckpoint.load(path).model_state())")
        raise ValueError(f"{path} has no paraloom header: it was not written by paraloom.save; "
                         "load its weights with paraloom.load(path, factory=build), build() "
                         "returning your model")
    try:
        spec = json.loads(meta[HEADER_KEY])
    except (json.JSONDecodeError, RecursionError) as e:  # RecursionError: nested too deep
        raise _corrupt(path, e) from e
    if not isinstance(spec, dict):
        raise _corrupt(path, TypeError(f"its paraloom header is a {type(spec).__name__}"))
    return spec


def read_tensors(path: str | Path, device: str | torch.device = "cpu") -> dict[str, Tensor]:
    """The tensors of a safetensors file; ValueError for a corrupt or truncated one."""
    from safetensors.torch import load_file

    try:
        return load_file(str(path), device=str(device))
    except Exception as e:  # safetensors' own error type (not a ValueError)
        raise _corrupt(path, e) from e


def read_consistently(path: str | Path, device: str | torch.device = "cpu", *,
                      plain: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """The header (``read_header``'s, with ``plain``) and the state_dict (the tensors, with
    the header's extra states) of one version of ``path``: a ``save`` that replaces the file
    between the two reads (it renames a new file over it) makes them read again."""
    for _ in range(_READ_TRIES):
        before = _identity(path)
        try:
            spec, state = read_header(path, plain=plain), read_tensors(path, device)
        except ValueError:
            if _identity(path) == before:
                raise
            continue  # replaced while read: a truncated view of the old or the new one
        if _identity(path) == before:
            return spec, join_extra_state(state, spec.get("extra_state"))
    raise ValueError(f"{path} was replaced {_READ_TRIES} times while it was read; read it "
                     "when no program is writing it")


_READ_TRIES = 5


def _identity(path: str | Path) -> tuple[int, int, int]:
    st = os.stat(path)
    return st.st_ino, st.st_mtime_ns, st.st_size


def _corrupt(path: str | Path, error: Exception) -> ValueError:
    return ValueError(f"{path} is not a readable safetensors file ({error}): it is truncated or "
                      "corrupt; write it again with paraloom.save")
